"""The start banner: Paddle's "Configuration Arguments" block and a "Distributed Envs" table."""

from __future__ import annotations

import threading
from datetime import timedelta

from rich.console import Console
from rich.table import Table

from longboat.launch.spec import LaunchSpec


def configuration_block(spec: LaunchSpec, master: str, node_ip: str) -> str:
    """``-----------  Configuration Arguments -----------`` and one ``key: value`` per option;
    ``node_ip`` is this node's own address (the one its ranks' endpoints use)."""
    values = {
        "target": spec.target + (" (module)" if spec.module else ""),
        "target_args": " ".join(spec.target_args),
        "nproc_per_node": spec.nproc_per_node,
        "gpus": ",".join(spec.devices) or None,
        "nnodes": f"{spec.min_nodes}:{spec.nnodes} (elastic)" if spec.elastic else spec.nnodes,
        "node_rank": "assigned at the rendezvous" if spec.elastic else spec.node_rank,
        "ips": ",".join(spec.ips) or (node_ip if spec.nnodes == 1 else None),
        "node_ip": node_ip,
        "master": master,
        "log_dir": spec.log_dir,
        "max_restarts": spec.max_restarts,
        "config": spec.config,
        "tee": "all" if spec.tee_all else "0",
        "servers": spec.servers or None,
        "workers": spec.workers or None,
    }
    lines = ["-----------  Configuration Arguments -----------"]
    lines += [f"{k}: {'' if v is None else v}" for k, v in values.items()]
    lines.append("------------------------------------------------")
    return "\n".join(lines)


def envs_table(rows: list[dict[str, str]], title: str = "Distributed Envs") -> Table:
    """One row per local rank: its rank, role, endpoint and device."""
    table = Table(title=title, title_justify="left")
    for column in rows[0]:
        table.add_column(column)
    for row in rows:
        table.add_row(*row.values())
    return table


def print_banner(
    spec: LaunchSpec, master: str, node_ip: str, rows: list[dict[str, str]], console: Console
) -> None:
    console.print(configuration_block(spec, master, node_ip), markup=False, highlight=False)
    console.print(envs_table(rows))


def servers_table(servers: list[str]) -> Table:
    """Every parameter server of the job: its index and endpoint."""
    return envs_table(
        [{"server": str(i), "endpoint": ep} for i, ep in enumerate(servers)],
        title="Parameter servers of the job",
    )


def print_job_servers_later(master: str, timeout: float, console: Console) -> None:
    """Multi-node PS: once the ranks have gathered the job-wide layout (through the rendezvous
    store on ``master``), print every server endpoint of the job; a note if it never comes."""

    def show() -> None:
        from longboat.launch import ps_layout

        try:
            import torch.distributed as dist

            host, _, port = master.rpartition(":")
            store = dist.PrefixStore(
                ps_layout.PREFIX,
                dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout)),
            )
            store.wait([ps_layout.SERVERS_KEY])
            servers = store.get(ps_layout.SERVERS_KEY).decode().split(",")
        except Exception as exc:  # the job may end (or fail) first: the banner is optional
            console.print(
                "longboat launch: could not read the job's server list from the rendezvous "
                f"store on {master} (waited at most {timeout:.0f}s: {type(exc).__name__}); "
                "each rank's environment has it as PADDLE_PSERVERS_IP_PORT_LIST",
                markup=False,
            )
            return
        console.print(servers_table(servers))

    threading.Thread(target=show, name="longboat-ps-banner", daemon=True).start()
