"""`batchsim models`: the zoo with families, parameter counts (total and active), weight bytes per
dtype and KV bytes per token;
`batchsim models build NAME`: materialize an mlx-lm loadable directory."""

from __future__ import annotations

import argparse

from batchsim.scripts.common import fmt, gib, out, table
from batchsim.server.models.spec import FLOAT_DTYPES, QUANT_BITS, zoo_names, zoo_spec


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", nargs="?", choices=["list", "build"], default="list",
                   help="list the zoo (default) or build a model directory")
    p.add_argument("name", nargs="?", help="zoo model to build")
    p.add_argument("--dtype", default="auto", choices=["auto", *FLOAT_DTYPES],
                   help="weights dtype to build (auto: float32 on CPU, float16 on a GPU)")
    p.add_argument("--quantize", type=int, choices=list(QUANT_BITS), default=None,
                   help="quantize the built weights to 4 or 8 bits with mlx-lm's quantizer")
    p.add_argument("--json", action="store_true", help="print only the JSON document")


def run(args: argparse.Namespace) -> dict:
    if args.action == "build":
        return _build(args)
    specs = [zoo_spec(n) for n in zoo_names()]
    rows = [s.summary() for s in specs]
    if not args.json:
        out.print(table(
            "Model zoo (weights and KV per token in GiB / KiB)",
            ["model", "family", "params", "active", "fp32 GiB", "fp16 GiB", "q8 GiB", "q4 GiB", "KV/token fp16 KiB",
             "layers", "kv_heads", "head_dim"],
            [[r["name"], "+".join(r["family"]), f"{r['params'] / 1e9:.2f}B",
              f"{r['active_params'] / 1e9:.2f}B", gib(r["weight_bytes"]["float32"]),
              gib(r["weight_bytes"]["float16"]), gib(r["weight_bytes"]["q8"]),
              gib(r["weight_bytes"]["q4"]), r["kv_bytes_per_token"]["float16"] / 1024,
              r["layers"], r["kv_heads"], r["head_dim"]] for r in rows],
        ))
        out.print("Build one with `batchsim models build NAME --dtype float32`; any command also "
                  "accepts a local model directory or a Hugging Face hub id.")
    return {"models": rows}


def _build(args: argparse.Namespace) -> dict:
    from batchsim.configs import ConfigError
    from batchsim.server.models.loader import resolve
    from batchsim.server.platform import env

    if not args.name:
        raise ConfigError(f"models build: name a zoo model: {', '.join(zoo_names())}")
    dtype = env.default_dtype() if args.dtype == "auto" else args.dtype
    ref = resolve(args.name, dtype, args.quantize)
    size = sum(f.stat().st_size for f in ref.path.iterdir() if f.is_file())
    if not args.json:
        out.print(f"{ref.name} ({dtype}{', q' + str(args.quantize) if args.quantize else ''}) "
                  f"is ready at {ref.path} ({fmt(gib(size))} GiB on disk)")
    return {"name": ref.name, "dtype": dtype, "quantize_bits": args.quantize, "path": str(ref.path),
            "disk_bytes": size}
