"""longboat inside other trainers: `longboat.integrations.lightning` (a Lightning strategy).

The DDP communication hook for trainers that build torch's DDP themselves is
``lb.ddp_comm_hook`` (`longboat.collective.ddp_hook`).
"""
