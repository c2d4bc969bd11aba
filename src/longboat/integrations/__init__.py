"""longboat inside other frameworks' entry points: `longboat.integrations.lightning` (a
Lightning strategy), `longboat.integrations.ddp_hook` (``lb.ddp_comm_hook``: longboat's
algorithms as a communication hook for trainers that build torch's DDP themselves) and
`longboat.integrations.compile` (``model.compile(...)``, ``lb.compile``: ``torch.compile`` cut
at the reducer's buckets, with `longboat.integrations.compile_split`).
"""
