"""Deviceless compiles of specjax's programs for a TPU or an H100, and what they show.

What it measures: XLA compiles a jitted program for an accelerator that is not present
(`../shared/aot/README.md`: libtpu's topologies, the CUDA plugin with an H100 description).
Nothing runs, so no times; per program and target it reports

* whether it compiled (else the error text) and the compile seconds;
* memory per device (`Compiled.memory_analysis()`: arguments, outputs, temporaries, aliased);
* GPU: the kernels of the thunk sequence (`kKernel` / `kCustomKernel` lines, each counted once
  where it stands in the program text: a kernel inside a loop body counts once, not once per
  iteration), those inside the round (the body of the top-level `kWhile` holding the most
  kernels), and the `kWhile` thunks not inside a `kCommandBuffer` (loops run from the host:
  each iteration is launched by the host; those without a known trip count also copy their
  condition back to the host and wait for the stream every iteration);
* TPU: the fusions (kernels) of the optimised HLO, all and those of the round;
* both: copies of large buffers (cache- or recurrent-state-sized: at least `large_bytes`, or of
  one of `large_shapes`) inside while-loop bodies of the optimised HLO: `copy` / `copy-start`
  instructions and copy fusions (a fusion whose fused root is a copy) in any computation
  reachable from a while body.

Programs are captured as a user gets them: `capture_generate` calls `specjax.generate` with
`specjax.api._compiled` (the one place executables are made) replaced by a recorder, so the
engine's entry points are whatever `generate` compiles today. While capturing and lowering,
`jax.default_backend()` answers the target's platform, so code that chooses by backend (the
parameter forms of `api.decode_params`, CPU-only barriers in the models) traces the
accelerator's program, not the CPU one.

The compilers (`jax[cuda12-local,tpu]` + `nvidia-cuda-nvcc-cu12`) live in their own
interpreter (`aot_python()`, `.venv-aot` made by `make aot`): installed beside the CPU venv's
jax they print a CUDA traceback and libtpu warnings at every start. The parsers need neither.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

#: Deviceless targets: name -> (platform, topology name).
TARGETS: dict[str, tuple[str, str]] = {
    "tpu-v5e": ("tpu", "v5e:2x2"),
    "tpu-v6e": ("tpu", "v6e:2x2"),
    "h100": ("cuda", "h100"),
}
#: Multi-chip targets, compiled over a mesh of all their chips (`mesh_devices`), not in the
#: default set: name -> (platform, topology name).
MESH_TARGETS: dict[str, tuple[str, str]] = {
    "tpu-v5e-8": ("tpu", "v5e:2x4"),
}


def platform_of(target: str) -> str:
    """The platform ("tpu" or "cuda") of a key of TARGETS or MESH_TARGETS."""
    return {**TARGETS, **MESH_TARGETS}[target][0]


#: What `jax.default_backend()` says on each platform.
_BACKEND = {"tpu": "tpu", "cuda": "gpu"}

_ROOT = Path(__file__).resolve().parent.parent
#: XLA's H100 SXM description (see ../shared/aot/README.md); SPECJAX_AOT_H100 overrides.
H100_DESCRIPTION_CANDIDATES = (
    _ROOT.parent / "shared" / "aot" / "h100_sxm.txtpb",
    _ROOT / "shared" / "aot" / "h100_sxm.txtpb",
)

#: Environment of an interpreter that compiles deviceless: CPU as the only runtime backend
#: (there is no driver), libtpu without its metadata-server probe and without its one-process
#: lock file (compiling touches no chip: several processes may compile at once), quieter C++
#: logs.
AOT_ENV = {
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    "JAX_PLATFORMS": "cpu",
    "TPU_SKIP_MDS_QUERY": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "SPECJAX_CPU_KERNELS": "0",
    "SPECJAX_COMPILE_CACHE": "0",
}


# --------------------------------------------------------------------------------------------
# Where the compilers are


def aot_python() -> Path | None:
    """The interpreter with the deviceless compilers: $SPECJAX_AOT_PYTHON, else
    `.venv-aot/bin/python` of this checkout; None where neither exists."""
    env = os.environ.get("SPECJAX_AOT_PYTHON")
    if env:
        return Path(env) if Path(env).exists() else None
    p = _ROOT / ".venv-aot" / "bin" / "python"
    return p if p.exists() else None


def h100_description() -> Path | None:
    env = os.environ.get("SPECJAX_AOT_H100")
    if env:
        return Path(env) if Path(env).exists() else None
    return next((p for p in H100_DESCRIPTION_CANDIDATES if p.exists()), None)


def missing_compilers() -> str | None:
    """Why this interpreter cannot compile deviceless for every target (None: it can)."""
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        return "libtpu is not installed in this interpreter"
    if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        return "the CUDA plugin (jax-cuda12-plugin) is not installed in this interpreter"
    nvcc = importlib.util.find_spec("nvidia.cuda_nvcc")
    have_ptxas = shutil.which("ptxas") is not None
    if not have_ptxas and nvcc is not None and nvcc.submodule_search_locations:
        for loc in nvcc.submodule_search_locations:
            have_ptxas |= Path(loc, "bin", "ptxas").exists()
    if not have_ptxas:
        return "ptxas not found (pip install nvidia-cuda-nvcc-cu12)"
    if h100_description() is None:
        return "no H100 description (shared/aot/h100_sxm.txtpb; or set SPECJAX_AOT_H100)"
    return None


# --------------------------------------------------------------------------------------------
# Thunk sequence (GPU)

_THUNK_LINE = re.compile(r"^(\s*)(\d+):\s+(k\w+)\s*(?:\[[^\]]*\])?\s*(\S*)")


@dataclasses.dataclass
class Thunk:
    """One line of a thunk sequence: id, kind, name (kernels), children by indentation."""

    id: int
    kind: str
    name: str
    indent: int
    children: list[Thunk] = dataclasses.field(default_factory=list)
    parent: Thunk | None = dataclasses.field(default=None, repr=False)

    def walk(self) -> Iterator[Thunk]:
        yield self
        for c in self.children:
            yield from c.walk()

    def ancestors(self) -> Iterator[Thunk]:
        p = self.parent
        while p is not None:
            yield p
            p = p.parent


KERNEL_KINDS = frozenset({"kKernel", "kCustomKernel"})


def parse_thunk_sequence(text: str) -> list[Thunk]:
    """The top-level thunks of a `*.thunk_sequence*.txt` dump, nested by indentation (the
    `condition:` / `body:` labels are skipped: a `kWhile`'s thunks are its children, the
    condition's first)."""
    roots: list[Thunk] = []
    stack: list[Thunk] = []
    for line in text.splitlines():
        m = _THUNK_LINE.match(line)
        if m is None:
            continue
        t = Thunk(int(m.group(2)), m.group(3), m.group(4), len(m.group(1).expandtabs()))
        while stack and stack[-1].indent >= t.indent:
            stack.pop()
        if stack:
            t.parent = stack[-1]
            stack[-1].children.append(t)
        else:
            roots.append(t)
        stack.append(t)
    return roots


def _walk_all(roots: Iterable[Thunk]) -> Iterator[Thunk]:
    for r in roots:
        yield from r.walk()


@dataclasses.dataclass
class ThunkStats:
    kernels: int
    #: kernels inside the top-level `kWhile` with the most of them (the round), 0 if none
    round_kernels: int
    #: `kWhile` thunks with no `kCommandBuffer` above them
    host_whiles: int
    command_buffers: int
    whiles: int
    #: per `kWhile`, in program order: its kernels not inside a nested `kWhile` (condition
    #: and body: what one iteration launches besides the nested loops)
    loop_kernels: list[int] = dataclasses.field(default_factory=list)


def _own_kernels(t: Thunk) -> int:
    return sum((c.kind in KERNEL_KINDS) + _own_kernels(c) for c in t.children if c.kind != "kWhile")


def thunk_stats(roots: Sequence[Thunk]) -> ThunkStats:
    every = list(_walk_all(roots))
    kernels = sum(t.kind in KERNEL_KINDS for t in every)
    host = sum(
        t.kind == "kWhile" and not any(a.kind == "kCommandBuffer" for a in t.ancestors())
        for t in every
    )
    top_whiles = [
        t for t in every
        if t.kind == "kWhile" and not any(a.kind == "kWhile" for a in t.ancestors())
    ]  # fmt: skip
    per_loop = [sum(x.kind in KERNEL_KINDS for x in w.walk()) for w in top_whiles]
    return ThunkStats(
        kernels=kernels,
        round_kernels=max(per_loop, default=0),
        host_whiles=host,
        command_buffers=sum(t.kind == "kCommandBuffer" for t in every),
        whiles=sum(t.kind == "kWhile" for t in every),
        loop_kernels=[_own_kernels(t) for t in every if t.kind == "kWhile"],
    )


# --------------------------------------------------------------------------------------------
# Optimised HLO text

_COMP_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"([a-z][\w\-]*)\(")
_CALLED = re.compile(
    r"\b(?:calls|to_apply|condition|body|true_computation|false_computation|"
    r"branch_computations|called_computations|scatter|select|comparator)="
    r"(\{[^}]*\}|%?[\w.\-]+)"
)
_ARRAY = re.compile(
    r"\b(pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f8\w*|bf16|f16|f32|f64|c64|c128|token)\[([\d,]*)\]"
)
_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "token": 0,
}  # fmt: skip


@dataclasses.dataclass
class Array_:
    dtype: str
    dims: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = _BYTES.get(self.dtype, 1)
        for d in self.dims:
            n *= d
        return n

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


@dataclasses.dataclass
class Instr:
    name: str
    opcode: str
    shapes: list[Array_]
    called: list[str]
    root: bool
    text: str
    kind: str = ""


@dataclasses.dataclass
class Computation:
    name: str
    entry: bool
    instrs: list[Instr]

    @property
    def root(self) -> Instr | None:
        return next((i for i in self.instrs if i.root), self.instrs[-1] if self.instrs else None)


def _split_type_and_rest(rhs: str) -> tuple[str, str]:
    """`TYPE opcode(...)...` -> (TYPE, rest); TYPE may be a tuple `(a, b)` with nesting."""
    rhs = rhs.lstrip()
    if rhs.startswith("("):
        depth = 0
        for i, ch in enumerate(rhs):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rhs[: i + 1], rhs[i + 1 :]
        return rhs, ""
    # an array type: up to the first space outside braces/brackets
    depth = 0
    for i, ch in enumerate(rhs):
        if ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == " " and depth == 0:
            return rhs[:i], rhs[i:]
    return rhs, ""


def _arrays(type_text: str) -> list[Array_]:
    # layouts (`{1,0:T(8,128)}`) hold no `dtype[` so the pattern skips them
    return [
        Array_(m.group(1), tuple(int(d) for d in m.group(2).split(",") if d))
        for m in _ARRAY.finditer(type_text)
    ]


def parse_hlo(text: str) -> dict[str, Computation]:
    """Computations of an HLO module's text (`Compiled.as_text()`), by name."""
    comps: dict[str, Computation] = {}
    current: Computation | None = None
    for line in text.splitlines():
        if current is None:
            m = _COMP_HEADER.match(line)
            if m and not line.lstrip().startswith("HloModule"):
                current = Computation(m.group(2), bool(m.group(1)), [])
            continue
        if line.strip() == "}":
            comps[current.name] = current
            current = None
            continue
        m = _INSTR.match(line)
        if m is None:
            continue
        type_text, rest = _split_type_and_rest(m.group(3))
        op = _OPCODE.search(rest)
        called: list[str] = []
        for c in _CALLED.finditer(rest):
            called += [
                s.strip().lstrip("%") for s in c.group(1).strip("{}").split(",") if s.strip()
            ]
        kind = re.search(r"\bkind=(k\w+)", rest)
        current.instrs.append(
            Instr(
                name=m.group(2),
                opcode=op.group(1) if op else "",
                shapes=_arrays(type_text),
                called=called,
                root=bool(m.group(1)),
                text=line.strip(),
                kind=kind.group(1) if kind else "",
            )
        )
    return comps


def fused_computations(comps: dict[str, Computation]) -> set[str]:
    """Names of computations called by fusions (their instructions are not kernels)."""
    return reachable(
        comps,
        [
            c
            for comp in comps.values()
            for i in comp.instrs
            if i.opcode == "fusion"
            for c in i.called
        ],
    )


def reachable(comps: dict[str, Computation], starts: Iterable[str]) -> set[str]:
    """Names of the computations `starts` name and those they call, transitively."""
    seen: set[str] = set()
    todo = list(starts)
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        todo += [c for i in comps[name].instrs for c in i.called]
    return seen


def while_bodies(comps: dict[str, Computation]) -> list[str]:
    """Body computations of every while instruction."""
    out = []
    for comp in comps.values():
        for i in comp.instrs:
            if i.opcode == "while":
                m = re.search(r"\bbody=%?([\w.\-]+)", i.text)
                if m:
                    out.append(m.group(1))
    return out


def _is_copy_fusion(comps: dict[str, Computation], instr: Instr) -> bool:
    if instr.opcode != "fusion":
        return False
    for name in instr.called:
        root = comps[name].root if name in comps else None
        if root is not None and root.opcode in ("copy", "copy-start"):
            return True
        if root is not None and root.opcode == "tuple":  # multi-output: any copy output
            ops = {i.name: i.opcode for i in comps[name].instrs}
            outs = re.findall(r"%([\w.\-]+)", root.text.split("tuple(", 1)[-1])
            if any(ops.get(o) in ("copy", "copy-start") for o in outs):
                return True
    return instr.name.startswith("copy")


def _large(a: Array_, min_bytes: int | None, shapes: set[tuple[int, ...]]) -> bool:
    return (min_bytes is not None and a.nbytes >= min_bytes) or a.dims in shapes


def _on_chip(instr: Instr) -> bool:
    """Whether an instruction's result lives in an alternate memory space (`S(1)`: a TPU's
    on-chip memory)."""
    return "S(1)" in _split_type_and_rest(instr.text.split("=", 1)[-1])[0]


def _chip_move(comp: Computation, instr: Instr) -> bool:
    """Whether a copy moves a buffer to or from on-chip memory: the memory-space
    assignment's prefetches and evictions, which read the buffer once but copy nothing in
    HBM (a tiny configuration's whole cache fits there)."""
    if _on_chip(instr):
        return True
    m = re.search(r"\bcopy\(%([\w.\-]+)\)", instr.text) if instr.opcode == "copy" else None
    source = next((i for i in comp.instrs if m and i.name == m.group(1)), None)
    return source is not None and _on_chip(source)


def large_copies_in_loops(
    comps: dict[str, Computation],
    min_bytes: int | None = None,
    shapes: Iterable[Sequence[int]] = (),
) -> list[str]:
    """Copies of large buffers inside while bodies: `copy` / `copy-start` instructions and
    copy fusions whose output (largest array of it) is at least `min_bytes` or of one of
    `shapes`, in every computation reachable from a while body (nested loops, conditionals,
    calls), fusion bodies excluded where their fusion is counted, copies to or from on-chip
    memory (`_chip_move`) excluded. One entry per instruction: `computation/instruction:
    type`."""
    want = {tuple(s) for s in shapes}
    fused = fused_computations(comps)
    inside = reachable(comps, while_bodies(comps))
    out = []
    for name in sorted(inside):
        for i in comps[name].instrs:
            is_copy = i.opcode in ("copy", "copy-start") or _is_copy_fusion(comps, i)
            if not is_copy or (name in fused and i.opcode != "copy"):
                continue
            if name in fused:  # a copy inside a fusion: counted through its fusion
                continue
            if _chip_move(comps[name], i):
                continue
            arrays = i.shapes if i.opcode != "copy-start" else i.shapes[:1]
            big = [a for a in arrays if _large(a, min_bytes, want)]
            if big:
                out.append(f"{name}/{i.name}: {max(big, key=lambda a: a.nbytes)}")
    return out


@dataclasses.dataclass
class HloStats:
    fusions: int
    #: fusions in the top-level while (of the entry) whose closure holds the most
    round_fusions: int
    whiles: int
    large_copies: list[str]


def hlo_stats(
    text: str, min_bytes: int | None = None, shapes: Iterable[Sequence[int]] = ()
) -> HloStats:
    comps = parse_hlo(text)
    fused = fused_computations(comps)

    def fusions_in(names: Iterable[str]) -> int:
        return sum(i.opcode == "fusion" for n in names if n not in fused for i in comps[n].instrs)

    entry = next((c for c in comps.values() if c.entry), None)
    rounds = []
    if entry is not None:
        for i in entry.instrs:
            if i.opcode == "while":
                rounds.append(fusions_in(reachable(comps, i.called)))
    return HloStats(
        fusions=fusions_in(comps),
        round_fusions=max(rounds, default=0),
        whiles=sum(i.opcode == "while" for c in comps.values() for i in c.instrs),
        large_copies=large_copies_in_loops(comps, min_bytes, shapes),
    )


# --------------------------------------------------------------------------------------------
# Compiling


@dataclasses.dataclass
class ProgramReport:
    """One program compiled for one target."""

    program: str
    target: str
    compiled: bool
    error: str | None = None
    compile_s: float = 0.0
    memory: dict[str, int] = dataclasses.field(default_factory=dict)
    hlo_whiles: int = 0
    large_copies: list[str] = dataclasses.field(default_factory=list)
    # GPU
    kernels: int | None = None
    round_kernels: int | None = None
    host_whiles: int | None = None
    command_buffers: int | None = None
    loop_kernels: list[int] | None = None  # `ThunkStats.loop_kernels`
    # TPU
    fusions: int | None = None
    round_fusions: int | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@contextlib.contextmanager
def backend_as(name: str) -> Iterator[None]:
    """`jax.default_backend()` answers `name` inside (code that picks by backend at trace
    time then traces the accelerator's program)."""
    import jax

    saved = jax.default_backend
    jax.default_backend = lambda: name  # type: ignore[assignment]
    try:
        yield
    finally:
        jax.default_backend = saved  # type: ignore[assignment]


def _topology(target: str) -> Any:
    from jax.experimental import topologies

    platform, name = {**TARGETS, **MESH_TARGETS}[target]
    if platform == "tpu":
        return topologies.get_topology_desc(topology_name=name, platform="tpu")
    desc = h100_description()
    if desc is None:
        raise FileNotFoundError("no H100 description (set SPECJAX_AOT_H100)")
    return topologies.get_topology_desc(
        topology_name=name, platform="cuda", target_config=desc.read_text(), topology="1x1x1"
    )


_TOPOLOGIES: dict[str, Any] = {}


def mesh_devices(target: str) -> list[Any]:
    """Every device of the target's topology (deviceless: nothing to run on)."""
    if target not in _TOPOLOGIES:
        _TOPOLOGIES[target] = _topology(target)
    return list(_TOPOLOGIES[target].devices)


def replicated(target: str) -> Any:
    """A replicated sharding over one device of the target's topology."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    return NamedSharding(Mesh(mesh_devices(target)[:1], ("x",)), PartitionSpec())


def abstract(args: Any, sharding: Any) -> Any:
    """Every array leaf of `args` (concrete or `ShapeDtypeStruct`) as a `ShapeDtypeStruct`
    placed by `sharding`; other leaves as they are."""
    import jax

    def leaf(x: Any) -> Any:
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return jax.ShapeDtypeStruct(
                tuple(x.shape), x.dtype, sharding=sharding, weak_type=getattr(x, "weak_type", False)
            )
        return x

    return jax.tree.map(leaf, args)


def _memory(compiled: Any) -> dict[str, int]:
    m = compiled.memory_analysis()
    if m is None:
        return {}
    out = {
        k: int(getattr(m, f"{k}_size_in_bytes", 0))
        for k in ("argument", "output", "alias", "temp", "generated_code")
    }
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def compile_for(
    fn: Callable[..., Any],
    args: Sequence[Any],
    target: str,
    *,
    static: Sequence[Any] = (),
    program: str | None = None,
    min_bytes: int | None = None,
    shapes: Iterable[Sequence[int]] = (),
    placed: bool = False,
) -> ProgramReport:
    """Compile `fn(*static, *args)` (a `jax.jit` function; `static` its leading static
    arguments) deviceless for `target` (a key of TARGETS or MESH_TARGETS) with `args` made
    abstract and replicated on one device, or, with `placed`, as given (`ShapeDtypeStruct`s
    carrying their shardings over the target's devices, `mesh_devices`), and measure it (see
    the module's docstring). Errors (of the lowering or of XLA) are reported, not raised."""
    from specjax.control import compiler_options  # (imports jax: the parsers need none)

    platform = platform_of(target)
    name = str(program or getattr(fn, "__name__", "program"))
    report = ProgramReport(program=name, target=target, compiled=False)
    dump = tempfile.mkdtemp(prefix="specjax-aot-")
    t_start = time.perf_counter()
    try:
        with backend_as(_BACKEND[platform]):
            abstract_args = tuple(args) if placed else abstract(tuple(args), replicated(target))
            t0 = time.perf_counter()
            lowered = fn.lower(*static, *abstract_args)  # type: ignore[attr-defined]
            # the options `specjax.generate` compiles with on that platform
            options: dict[str, Any] = dict(compiler_options(platform))
            if platform == "cuda":
                options["xla_dump_to"] = dump
            compiled = lowered.compile(compiler_options=options or None)
            report.compile_s = time.perf_counter() - t0
        report.compiled = True
        report.memory = _memory(compiled)
        hs = hlo_stats(compiled.as_text(), min_bytes, shapes)
        report.hlo_whiles, report.large_copies = hs.whiles, hs.large_copies
        if platform == "tpu":
            report.fusions, report.round_fusions = hs.fusions, hs.round_fusions
        else:
            files = sorted(glob.glob(os.path.join(dump, "*thunk_sequence_after_thunk_passes.txt")))
            files = files or sorted(glob.glob(os.path.join(dump, "*thunk_sequence.txt")))
            if files:
                ts = thunk_stats(parse_thunk_sequence(Path(files[-1]).read_text()))
                report.kernels, report.round_kernels = ts.kernels, ts.round_kernels
                report.host_whiles, report.command_buffers = ts.host_whiles, ts.command_buffers
                report.loop_kernels = ts.loop_kernels
            else:
                report.error = "compiled, but XLA wrote no thunk sequence"
    except Exception as err:  # reported per program
        report.error = f"{type(err).__name__}: {err}"[:4000]
        report.compile_s = report.compile_s or time.perf_counter() - t_start
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    return report


# --------------------------------------------------------------------------------------------
# Capturing what `specjax.generate` compiles


@dataclasses.dataclass
class Captured:
    """One executable `generate` asked `api._compiled` for: `fn(engine, *args)`."""

    fn: Any
    engine: Any
    args: tuple[Any, ...]

    @property
    def name(self) -> str:
        return str(getattr(self.fn, "__name__", "program"))


class _Stub:
    """Stands in for an executable: `out_info` as the real one, called it returns zeros of
    that structure (what `generate` does with them afterwards does not matter here)."""

    def __init__(self, out_info: Any) -> None:
        self.out_info = out_info

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import jax
        import jax.numpy as jnp

        def zeros(s: Any) -> Any:
            try:
                return jnp.zeros(s.shape, s.dtype)
            except TypeError:  # typed PRNG keys
                return jax.random.key_data(jax.random.key(0)).astype("uint32") * 0

        return jax.tree.map(zeros, self.out_info)


def capture_generate(
    *args: Any, backend: str = "gpu", **kwargs: Any
) -> tuple[list[Captured], str | None]:
    """Call `specjax.generate(*args, **kwargs)` with executables recorded instead of
    compiled (and nothing run: stubs return zeros), `jax.default_backend()` answering
    `backend`. Returns the captures and the error `generate` ended with after them (None if
    it returned; its outputs are meaningless)."""
    import jax

    import specjax
    from specjax import api

    captured: list[Captured] = []

    def record(fn: Any, engine: Any, *fargs: Any) -> Any:
        captured.append(Captured(fn, engine, fargs))
        return _Stub(fn.trace(engine, *fargs).out_info)

    saved = api._compiled
    saved_env = os.environ.get("SPECJAX_CPU_KERNELS")
    os.environ["SPECJAX_CPU_KERNELS"] = "0"
    api._compiled = record  # type: ignore[assignment]
    error = None
    try:
        with backend_as(backend):
            specjax.generate(*args, **kwargs)
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    finally:
        api._compiled = saved  # type: ignore[assignment]
        if saved_env is None:
            os.environ.pop("SPECJAX_CPU_KERNELS", None)
        else:
            os.environ["SPECJAX_CPU_KERNELS"] = saved_env
        jax.clear_caches()
    return captured, error


def compile_captured(
    captured: Sequence[Captured],
    target: str,
    *,
    min_bytes: int | None = None,
    shapes: Iterable[Sequence[int]] = (),
) -> list[ProgramReport]:
    """`compile_for` each captured program (static engine) for `target`."""
    return [
        compile_for(
            c.fn,
            c.args,
            target,
            static=(c.engine,),
            program=c.name,
            min_bytes=min_bytes,
            shapes=shapes,
        )
        for c in captured
    ]


def ensure_compilers() -> None:
    """Make this process one that compiles deviceless: re-execute the script (`sys.argv`)
    under `aot_python()` when this interpreter has no compilers, or under itself when
    AOT_ENV is not all set (JAX reads it at import); exit with the reason when there is no
    such interpreter. Variables the user set win."""
    missing = missing_compilers()
    if missing is None and all(k in os.environ for k in AOT_ENV):
        return
    py = Path(sys.executable) if missing is None else aot_python()
    if py is None or (
        missing is not None and os.path.abspath(sys.executable) == os.path.abspath(py)
    ):
        sys.exit(f"deviceless compilers unavailable: {missing} (run `make aot`)")
    os.execve(str(py), [str(py), *sys.argv], {**AOT_ENV, **os.environ})
