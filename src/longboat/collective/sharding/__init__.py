"""Moved: sharding stages 1 and 2 are `longboat.sharding.zero`, their settings
`longboat.sharding.config`. Only ``memory`` stays here, for the import earlier docs showed."""
