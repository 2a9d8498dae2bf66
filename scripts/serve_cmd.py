"""`batchsim serve --model NAME`: an OpenAI-compatible HTTP server (completions, chat, streaming,
/metrics) on the continuous-batching engine of `batchsim run`. Point any OpenAI client, or
`batchsim run --target http://HOST:PORT/v1`, at it."""

from __future__ import annotations

import argparse
import sys

from batchsim.scripts.common import (
    MAX_INT,
    add_field_argument,
    add_rank_arguments,
    bounded,
    err,
    gib_text,
    non_negative_float,
    port_int,
)
from batchsim.scripts.run_args import (
    add_kv_bits_arg,
    add_model_args,
    add_scheduler_args,
    scheduler_overrides,
)
from batchsim.scripts.spec_args import add_spec_args
from batchsim.server.http.options import ServeOptions

LISTENING = "batchsim serve: listening on "  # tests and scripts parse this stderr line


def add_parser(p: argparse.ArgumentParser) -> None:
    add_kv_bits_arg(add_model_args(p, simulated=False))
    add_scheduler_args(p)
    add_spec_args(p, simulated=False)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    g.add_argument("--port", type=port_int, default=8000, help="port; 0 picks a free one")
    add_field_argument(g, ServeOptions, "api_key",
                       "require `Authorization: Bearer KEY` on /v1/* routes")
    g.add_argument("--served-model-name", help="model name clients send [default: --model]")
    add_field_argument(g, ServeOptions, "max_queue", "waiting requests beyond which new ones get "
                       "429 with Retry-After", unset=False)
    add_field_argument(g, ServeOptions, "max_body_bytes", "largest request body", unset=False,
                       type=bounded(int, 1024, MAX_INT))
    add_field_argument(g, ServeOptions, "max_prompt_bytes", "largest prompt text in UTF-8 bytes "
                       "(larger: 413); unset: 32 bytes per token of the model's context")
    add_field_argument(g, ServeOptions, "header_timeout_s", "a connection that has not sent a "
                       "complete request head this long after opening (or after its last "
                       "response) is closed", unset=False)
    add_field_argument(g, ServeOptions, "body_timeout_s", "a request body not received this long "
                       "after its head gets 408", unset=False)
    add_field_argument(g, ServeOptions, "drain_timeout_s", "on SIGINT/SIGTERM/SIGHUP, how long "
                       "in-flight requests may finish before abort", unset=False,
                       type=non_negative_float)
    add_rank_arguments(p, "serve", "rank 0 answers HTTP and schedules, the others run its "
                       "plans; the KV budget is per rank")


def _config(args: argparse.Namespace):
    from batchsim.configs import ConfigError
    from batchsim.server.engine.run_config import RunConfig, with_run_overrides

    try:  # the scheduler limits are checked as run checks them (SchedulerSettings)
        return with_run_overrides(
            RunConfig(), {}, model=args.model, dtype=args.dtype, quantize=args.quantize,
            kv_bits=args.kv_bits, kv_layout=args.kv_layout, memory_gb=args.memory_gb,
            **scheduler_overrides(args),
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def run(args: argparse.Namespace) -> dict | None:
    from batchsim.server.engine.session import open_session

    cfg = _config(args)
    _check_names(args)
    if args.ranks > 1 or args.hostfile:
        return _serve_ranks(args, cfg)
    return _serve(args, cfg, open_session(cfg))


def _check_names(args: argparse.Namespace) -> None:
    """Before the model loads: an empty --api-key (an unset $KEY) would look open but refuse
    every client; an empty --served-model-name matches no client's `model`."""
    from batchsim.configs import ConfigError

    for flag, value in (("--api-key", args.api_key), ("--served-model-name",
                                                      args.served_model_name)):
        if value is not None and (not value.strip() or not value.isprintable()):
            shown = "" if flag == "--api-key" else f", got {value!r}"  # a key is not echoed
            raise ConfigError(f"{flag}: must be non-empty printable text{shown}")


def _serve_ranks(args: argparse.Namespace, cfg) -> dict | None:
    """Rank 0 serves with an executor that broadcasts each plan; the other ranks follow."""
    from batchsim.scripts.common import CommandFailed
    from batchsim.server.distributed import rank

    if rank.is_rank_process():
        with rank.joined(cfg) as lead:
            return None if lead is None else lead.finish(_serve(args, cfg, lead.session))
    from batchsim.server.distributed.launch import launch, prebuild
    from batchsim.server.platform.env import default_dtype

    dtype = cfg.dtype if cfg.dtype != "auto" else default_dtype()
    prebuild(cfg.model, dtype, cfg.quantize, args.ranks, local=not args.hostfile)
    try:
        launch(getattr(args, "_argv", None) or sys.argv[1:], args.ranks, args.hostfile, server=True)
    except RuntimeError as exc:
        raise CommandFailed(str(exc), {"error": str(exc), "ranks": args.ranks}) from None
    return None  # rank 0 printed the summary


def opened_line(session, served_name: str, ranks: int) -> str:
    """What serve prints once the model is loaded (the KV budget as `run`'s header gives it)."""
    cfg = session.config
    kv = f", KV {cfg.kv_bits}-bit" if cfg.kv_bits else ""
    return (f"batchsim serve: {session.ref.name} ({session.dtype}{kv}) as {served_name!r}, "
            f"max_num_seqs {cfg.scheduler.max_num_seqs}, KV budget "
            f"{gib_text(session.kv_budget_bytes)}{' per rank' if ranks > 1 else ''} "
            f"({session.budget_source})")


def _serve(args: argparse.Namespace, cfg, session) -> dict:
    import asyncio

    from batchsim.server.http.app import Server, serve

    options = ServeOptions(
        served_model_name=args.served_model_name or cfg.model, api_key=args.api_key,
        max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
        max_prompt_bytes=args.max_prompt_bytes, header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s, drain_timeout_s=args.drain_timeout_s,
        max_model_len=session.spec.max_context, vocab_size=session.spec.vocab_size,
        kv_budget_bytes=session.kv_budget_bytes, memory_budget_bytes=session.memory_budget_bytes,
    )
    err.print(opened_line(session, options.served_model_name, args.ranks), markup=False)

    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        err.print(f"batchsim serve: bound to {args.host} without --api-key: anyone who can reach "
                  "this port can use it", style="yellow", markup=False)

    def announce(url: str) -> None:
        print(f"{LISTENING}{url}", file=sys.stderr, flush=True)

    async def main() -> dict:
        server = Server(session.new_scheduler(), session.executor, session.tokenizer, options)
        stop = None
        if args.ranks > 1 or args.hostfile:  # rank 0: a peer's death must not leave it draining
            from batchsim.server.distributed import stop_signals

            stop = stop_signals.install(server, options.drain_timeout_s)
        return await serve(server, args.host, args.port, announce, stop)

    if not (args.ranks > 1 or args.hostfile):  # rank 0 answers its noted ones in install
        from batchsim.server.platform.signals import stop_if_swallowed

        stop_if_swallowed()  # a Ctrl-C Python swallowed while the model loaded: not served on
    totals = asyncio.run(main())
    err.print(f"batchsim serve: stopped; {totals['requests']}")
    return {"command": "serve", "model": session.ref.name, **totals}
