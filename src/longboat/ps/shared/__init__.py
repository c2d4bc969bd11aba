"""What the server and trainer processes of parameter-server mode share: the wire format
(``wire``), the gRPC service and its limits (``service``), the job token (``auth``), the
request protocol's keys and refusals (``request``), the server optimizers' names and rules
(``optim``) and the initial values of sparse rows (``rows``). Nothing here imports
``longboat.ps.server`` or ``longboat.ps.trainer``."""
