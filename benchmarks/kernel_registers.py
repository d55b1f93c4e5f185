"""Registers and spills of the fused kernels compiled for an H100/H200 (sm_90a), no GPU needed.

``env -u TRITON_INTERPRET python benchmarks/kernel_registers.py > OUT.txt``: for head sizes
and tiles the launcher uses, each product precision (DOT 0 ieee, 1 tf32, 2 bf16) and 1, 2,
3 and 6 measures per launch, Triton compiles ``rows`` (top-8 keys) and ``cols`` and the
ptxas it ships reports (registers per thread, bytes of spill stores). Prints one line each.
"""

# ruff: noqa

import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from contribution_weights.measures import triton_kernels as tk

kernels = tk.build()
INTS = {"START", "STOP", "KEY_LO", "KEY_HI", "QUERY_LO", "QUERY_HI", "TOP_I"}
OPERANDS = {"Q", "K", "V", "BACK", "LEFT"}


def signature(fn, constants):
    sig = {}
    for name in fn.arg_names:
        if name in constants:
            sig[name] = "constexpr"
        elif name.isupper():
            bf16 = constants.get("DOT") == 2 and name in OPERANDS
            sig[name] = "*i32" if name in INTS else "*bf16" if bf16 else "*fp32"
        else:
            sig[name] = "fp32" if name in ("scaling", "softcap") else "i32"
    return sig


def build(fn, constants):
    src = ASTSource(fn, signature(fn, constants), constants)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32))


import subprocess, re, os, json, tempfile
from triton.backends.nvidia.compiler import get_ptxas

ptxas = get_ptxas(90).path
MEAS = [1, 0, 2, 4, 5, 6]  # contribution first
out = {}
for d, tile in ((128, 32), (64, 64), (64, 32), (128, 16)):
    tiles = dict(BLOCK_M=tile, BLOCK_N=tile, BLOCK_D=d)
    for dot in (0, 1, 2):
        for n in (1, 2, 3, 6):
            slots = MEAS[:n] + [-1] * (8 - n)
            used = set(slots)
            flags = dict(
                ALPHA=bool(used & {0, 1, 2, 5, 6, 7}),
                P=bool(used & {1, 3, 4, 7}),
                PH=2 in used,
                VNORM=bool(used & {4, 5, 6}),
                ONORM=bool(used & {4, 6}),
                SOFTCAP=False,
                DOT=dot,
                INTERPRET=False,
                **{f"M{i}": m for i, m in enumerate(slots)},
                **tiles,
            )
            for kind, fn, extra_c in (
                ("rows", kernels.rows, dict(TOPK=8, TOPK_PAD=8)),
                ("cols", kernels.cols, {}),
            ):
                c = build(fn, dict(**extra_c, **flags))
                ptx = c.asm["ptx"]
                f = tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False)
                f.write(ptx)
                f.close()
                r = subprocess.run(
                    [ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", "/dev/null"],
                    capture_output=True,
                    text=True,
                )
                txt = r.stderr + r.stdout
                regs = re.search(r"Used (\d+) registers", txt)
                spill = re.search(r"(\d+) bytes spill stores", txt)
                key = f"d{d} t{tile} dot{dot} n{n} {kind}"
                out[key] = (
                    int(regs.group(1)) if regs else None,
                    int(spill.group(1)) if spill else None,
                )
                print(key, out[key], flush=True)
