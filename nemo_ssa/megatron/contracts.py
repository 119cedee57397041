"""The call contract of every megatron-core slot we fill, read from megatron-core's source.

Our modules sit in slots megatron builds and calls: ``FusedReLU2MLP`` in the MLP slot,
``NSASelfAttention`` / ``FusedRopeSelfAttention`` in ``self_attention``, the core attentions in
``core_attention``, ``LayerNorm1P`` in the layer norms. Megatron's caller decides what they
are handed; a keyword our module does not take is a ``TypeError`` at the first step on the
GPU (megatron-core 0.16 passing ``padding_mask`` to the MLP was one). So the contract is read
from the caller's source with :mod:`ast` -- not imported, so the source of a version that
does not install here (0.17+ needs Python 3.12) can be checked too:

- every call into a slot: ``self.mlp(...)``, ``apply_module(self.mlp)(...)``,
  ``build_module(submodules.mlp, ...)``, ``submodules.mlp(...)``, and the target handed to a
  wrapper (``functools.partial(apply_module(self.mlp), padding_mask=...)``, checkpointing);
- its keywords, with ``**d`` expanded where ``d`` is a dict built in the same function
  (``d["k"] = ...``, ``d = {...}``) and reported as *opaque* otherwise;
- its positional count where the call is direct.

:func:`check` matches each call against our module's own signature (``inspect``) or, where our
class inherits the method from megatron, against that version's megatron method parsed from
the same source. It also checks one call the other way, ours into megatron:
``FusedRopeSelfAttention`` reads q, k, v from what ``get_query_key_value_tensors(...,
split_qkv=False)`` returns (:func:`qkv_buffer_problems`). tests/megatron/test_contracts.py runs it on the installed megatron-core and on
the sources scripts/env.sh unpacks (:func:`source_roots`); ``python -m
nemo_ssa.megatron.contracts [ROOT ...]`` prints the findings.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

__all__ = ["CallSite", "Slot", "SLOTS", "OPAQUE_OK", "MOE_ONLY", "find_calls", "slot_calls", "check",
           "source_roots", "installed_root", "SOURCES_ENV", "parse_function", "signature_from_ast",
           "qkv_buffer_problems"]

#: overrides where the unpacked sources are (default ``<sys.prefix>/sources``)
SOURCES_ENV = "NEMO_SSA_MEGATRON_SOURCES"

#: wrappers that call their first argument with the rest of their own arguments
_WRAPPERS = ("partial", "checkpoint", "te_checkpoint")


@dataclasses.dataclass(frozen=True)
class CallSite:
    """One call into a slot, as the source writes it."""

    file: str
    line: int
    where: str  # Class.function
    positional: Optional[int]  # None: a wrapper adds positionals we cannot count
    keywords: FrozenSet[str]
    opaque: Tuple[str, ...]  # ``**expr`` we could not expand

    def __str__(self) -> str:
        pos = "?" if self.positional is None else self.positional
        extra = f" **{', **'.join(self.opaque)}" if self.opaque else ""
        return f"{self.file}:{self.line} {self.where}: {pos} positional, keywords {sorted(self.keywords)}{extra}"


def _dotted(node: ast.AST) -> Optional[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _is_target(node: ast.AST, targets: Sequence[str]) -> bool:
    """``target``, or ``apply_module(target)`` / ``not_none(target)`` (megatron 0.16+ calls
    modules through the one and builds optional slots through the other)."""
    if isinstance(node, ast.Call) and _dotted(node.func) in ("apply_module", "not_none") and node.args:
        node = node.args[0]
    return _dotted(node) in targets


def _dict_keys(func: ast.AST, name: str) -> Optional[FrozenSet[str]]:
    """Constant keys a function puts into the local dict ``name``; None if not such a dict."""
    keys, built = set(), False
    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            if isinstance(node.value, ast.Dict):
                built = True
                for k in node.value.keys:
                    if not isinstance(k, ast.Constant):
                        return None
                    keys.add(k.value)
            elif isinstance(node.value, ast.Call) and _dotted(node.value.func) == "dict" and not node.value.args:
                built = True
                keys.update(kw.arg for kw in node.value.keywords if kw.arg)
            else:
                return None
        targets = node.targets if isinstance(node, ast.Assign) else []
        for t in targets:
            if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == name:
                if not isinstance(t.slice, ast.Constant):
                    return None
                keys.add(t.slice.value)
    return frozenset(keys) if built else None


def _call_site(call: ast.Call, func: ast.AST, file: str, where: str, skip_positional: int,
               countable: bool) -> CallSite:
    keywords, opaque = set(), []
    for kw in call.keywords:
        if kw.arg is not None:
            keywords.add(kw.arg)
            continue
        keys = _dict_keys(func, kw.value.id) if isinstance(kw.value, ast.Name) else None
        if keys is None:
            opaque.append(ast.unparse(kw.value))
        else:
            keywords.update(keys)
    positional = None
    if countable and not any(isinstance(a, ast.Starred) for a in call.args):
        positional = len(call.args) - skip_positional
    return CallSite(file, call.lineno, where, positional, frozenset(keywords), tuple(opaque))


def find_calls(source: str, targets: Sequence[str], classes: Optional[Sequence[str]] = None,
               file: str = "<source>") -> List[CallSite]:
    """Every call into ``targets`` (dotted names: ``self.mlp``, ``submodules.mlp``) inside the
    methods of ``classes`` (every function when None)."""
    tree = ast.parse(source)
    scopes: List[Tuple[str, ast.AST]] = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and (classes is None or node.name in classes):
            scopes += [(f"{node.name}.{f.name}", f) for f in node.body
                       if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
        elif classes is None and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            scopes.append((node.name, node))
    found = []
    for where, func in scopes:
        for call in (n for n in ast.walk(func) if isinstance(n, ast.Call)):
            name = _dotted(call.func) or ""
            if _is_target(call.func, targets):  # target(...) / apply_module(target)(...)
                found.append(_call_site(call, func, file, where, 0, countable=True))
            elif name.split(".")[-1] == "build_module" and call.args and _dotted(call.args[0]) in targets:
                found.append(_call_site(call, func, file, where, 1, countable=True))
            elif name.split(".")[-1] in _WRAPPERS and call.args and _is_target(call.args[0], targets):
                found.append(_call_site(call, func, file, where, 0, countable=False))
    return sorted(found, key=lambda c: c.line)


def parse_function(source: str, cls: Optional[str], name: str) -> Optional[ast.FunctionDef]:
    """The ``def name`` of class ``cls`` (module level when None) in ``source``."""
    tree = ast.parse(source)
    body = tree.body
    if cls is not None:
        body = next((n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), [])
    return next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name), None)


class _Default:
    """A parsed default value (its source text): present, never evaluated."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def signature_from_ast(fn: ast.FunctionDef, bound: bool = True) -> inspect.Signature:
    """An :class:`inspect.Signature` of a parsed ``def`` (without ``self``/``cls`` when
    ``bound``), so parsed and imported functions are checked the same way."""
    a, P = fn.args, inspect.Parameter
    params: List[inspect.Parameter] = []
    positional = [(x, P.POSITIONAL_ONLY) for x in a.posonlyargs] + [(x, P.POSITIONAL_OR_KEYWORD) for x in a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for (arg, kind), d in zip(positional, defaults):
        params.append(P(arg.arg, kind, default=P.empty if d is None else _Default(ast.unparse(d))))
    if a.vararg:
        params.append(P(a.vararg.arg, P.VAR_POSITIONAL))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        params.append(P(arg.arg, P.KEYWORD_ONLY, default=P.empty if d is None else _Default(ast.unparse(d))))
    if a.kwarg:
        params.append(P(a.kwarg.arg, P.VAR_KEYWORD))
    if bound and params and params[0].kind != P.VAR_POSITIONAL:
        params = params[1:]
    return inspect.Signature(params)


def _problems(sig: inspect.Signature, call: CallSite, provided: FrozenSet[str] = frozenset()) -> List[str]:
    """What ``sig`` cannot take of ``call`` (``provided``: keywords the spec adds)."""
    P = inspect.Parameter
    params = list(sig.parameters.values())
    var_kw = any(p.kind == P.VAR_KEYWORD for p in params)
    by_kw = {p.name for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    out = [f"keyword {k!r} not accepted" for k in sorted(call.keywords | provided) if k not in by_kw and not var_kw]
    if call.positional is not None:
        positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
        if call.positional > len(positional) and not any(p.kind == P.VAR_POSITIONAL for p in params):
            out.append(f"{call.positional} positional arguments, takes {len(positional)}")
        filled = {p.name for p in positional[:call.positional]} | call.keywords | provided
        missing = [p.name for p in params if p.default is P.empty and p.kind in (P.POSITIONAL_ONLY,
                   P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY) and p.name not in filled]
        if missing and not call.opaque:
            out.append(f"required {missing} not passed")
    return out


# ------------------------------------------------------------------------------ the slots
@dataclasses.dataclass(frozen=True)
class Slot:
    """A slot: where megatron calls it, and which of our callables must take those calls."""

    name: str
    file: str  # relative to megatron/core/
    classes: Tuple[str, ...]
    targets: Tuple[str, ...]
    ours: Tuple[str, ...]  # "module:Class.method"
    provided: FrozenSet[str] = frozenset()  # keywords our spec adds (ModuleSpec params / partial)
    since: Tuple[int, int] = (0, 0)  # megatron-core version where this caller first exists
    until: Tuple[int, int] = (99, 0)  # first version where it no longer applies to us


_MLP = "nemo_ssa.megatron.mlp:FusedReLU2MLP"
_NSA = "nemo_ssa.megatron.nsa_attention:NSASelfAttention"
_ROPE = "nemo_ssa.megatron.self_attention:FusedRopeSelfAttention"
_LN = "nemo_ssa.megatron.layernorm:LayerNorm1P"


def _core_attention_classes() -> Tuple[str, ...]:
    from nemo_ssa.megatron.spec import CORE_ATTENTIONS

    return tuple(sorted({f"{c.__module__}:{c.__name__}" for c in CORE_ATTENTIONS.values()}))


def _slots() -> Tuple[Slot, ...]:
    core = _core_attention_classes()
    tl, layer = "transformer/transformer_layer.py", ("TransformerLayer",)
    return (
        # up to 0.17 the spec holds ModuleSpec(FusedReLU2MLP, submodules=...): build_module(...)
        Slot("mlp construction", tl, layer, ("submodules.mlp",), (f"{_MLP}.__init__",),
             provided=frozenset({"submodules"}), until=(0, 18)),
        # 0.18+: the spec holds partial(FusedReLU2MLP.as_mlp_submodule, submodules=...)
        # (compat.mlp_slot), which TransformerLayer calls
        Slot("mlp construction", tl, layer, ("submodules.mlp",), (f"{_MLP}.as_mlp_submodule",),
             provided=frozenset({"submodules"}), since=(0, 18)),
        Slot("mlp forward", tl, layer, ("self.mlp",), (f"{_MLP}.forward",)),
        Slot("self_attention construction", tl, layer, ("submodules.self_attention",),
             (f"{_NSA}.__init__", f"{_ROPE}.__init__"), provided=frozenset({"submodules"})),
        Slot("self_attention forward", tl, layer, ("self.self_attention",), (f"{_NSA}.forward", f"{_ROPE}.forward")),
        # FusedRopeSelfAttention overrides it (the QKV-buffer path); Attention.forward calls it
        Slot("qkv tensors", "transformer/attention.py", ("Attention", "SelfAttention"),
             ("self.get_query_key_value_tensors",), (f"{_ROPE}.get_query_key_value_tensors",)),
        Slot("core_attention construction", "transformer/attention.py", ("Attention", "SelfAttention"),
             ("submodules.core_attention",), tuple(f"{c}.__init__" for c in core)),
        Slot("core_attention forward", "transformer/attention.py", ("Attention", "SelfAttention"),
             ("self.core_attention",), tuple(f"{c}.forward" for c in core)),
        Slot("layer norm construction", tl, layer, ("submodules.input_layernorm", "submodules.pre_mlp_layernorm"),
             (f"{_LN}.__init__",)),
        Slot("layer norm forward", tl, layer, ("self.input_layernorm", "self.pre_mlp_layernorm"), (f"{_LN}.forward",)),
        Slot("final layer norm construction", "transformer/transformer_block.py", ("TransformerBlock",),
             ("self.submodules.layer_norm", "submodules.layer_norm"), (f"{_LN}.__init__",)),
        Slot("final layer norm forward", "transformer/transformer_block.py", ("TransformerBlock",),
             ("self.final_layernorm",), (f"{_LN}.forward",)),
    )


SLOTS = _slots()

#: calls into the MLP slot made only for MoE layers (router, expert dispatch, CUDA-graph
#: pieces of the MoE path): our MLP is dense and layer_spec refuses ``num_moe_experts``
MOE_ONLY = frozenset({
    "TransformerLayer._forward_mlp_router", "TransformerLayer._forward_mlp_expert_compute",
    "TransformerLayer._forward_mlp_postprocess", "TransformerLayer._forward_moe_expert_compute",
})

#: ``**expr`` a caller passes that cannot be expanded statically, and why our modules need
#: not take it; a new one fails the check until someone reads it and adds it here
OPAQUE_OK: Dict[Tuple[str, str], str] = {
    ("core_attention forward", "extra_kwargs"): (
        "Attention._run_core_attention(**extra_kwargs): the core_attention_extra_kwargs of "
        "_checkpointed_attention_forward, which Attention/SelfAttention never pass (DSA-style "
        "subclasses do, with their own core attention); checked by test_contracts"),
}


def _version_of(root: str) -> Tuple[int, ...]:
    path = os.path.join(root, "megatron", "core", "package_info.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    vals = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) \
                and isinstance(node.value, ast.Constant):
            vals[node.targets[0].id] = node.value.value
    return tuple(int(vals[k]) for k in ("MAJOR", "MINOR", "PATCH"))


def _read(root: str, rel: str) -> str:
    with open(os.path.join(root, "megatron", "core", rel), encoding="utf-8") as f:
        return f.read()


def slot_calls(root: str, slot: Slot) -> List[CallSite]:
    """Every call into ``slot`` in the megatron-core under ``root`` (MoE-only calls left out)."""
    calls = find_calls(_read(root, slot.file), slot.targets, slot.classes, file=slot.file)
    return [c for c in calls if c.where not in MOE_ONLY]


def _resolve(ref: str) -> Tuple[type, str]:
    mod, rest = ref.split(":")
    cls, method = rest.split(".")
    return getattr(importlib.import_module(mod), cls), method


def our_signature(ref: str, root: Optional[str] = None) -> Tuple[Optional[inspect.Signature], str]:
    """The signature the version under ``root`` sees for ``ref``: ours (inspect) where our
    class defines the method, megatron's of that version (parsed) where it inherits it."""
    cls, method = _resolve(ref)
    for klass in cls.__mro__:
        if method not in vars(klass):
            continue
        where = f"{klass.__module__}.{klass.__qualname__}.{method}"
        if root is not None and klass.__module__.startswith("megatron."):
            rel = klass.__module__.split(".", 2)[2].replace(".", "/") + ".py"
            fn = parse_function(_read(root, rel), klass.__name__, method)
            if fn is None:
                return None, f"{klass.__name__}.{method} is not in {rel} of this version"
            return signature_from_ast(fn), f"megatron {rel}:{klass.__name__}.{method}, parsed"
        sig = inspect.signature(getattr(cls, method))
        if not isinstance(vars(klass)[method], (classmethod, staticmethod)):  # drop self
            sig = sig.replace(parameters=list(sig.parameters.values())[1:])
        return sig, where
    return None, f"{cls.__name__} has no {method}"


def check(root: str) -> Tuple[Tuple[int, ...], List[str], List[str]]:
    """Check every slot against the megatron-core under ``root`` (the directory holding
    ``megatron/``). Returns (version, problems, report lines)."""
    version = _version_of(root)
    installed = os.path.realpath(root) == os.path.realpath(installed_root() or "")
    problems, report = [], []
    for slot in SLOTS:
        if not slot.since <= version[:2] < slot.until:
            continue
        calls = slot_calls(root, slot)
        if not calls:
            problems.append(f"{slot.name}: no call into {slot.targets} found in {slot.file} (the slot moved?)")
        for ref in slot.ours:
            sig, origin = our_signature(ref, None if installed else root)
            if sig is None:
                problems.append(f"{slot.name}: {ref}: {origin}")
                continue
            for call in calls:
                for why in _problems(sig, call, slot.provided):
                    problems.append(f"{slot.name}: {ref.split(':')[1]} ({origin}) <- {call}: {why}")
                for expr in call.opaque:
                    if (slot.name, expr) not in OPAQUE_OK:
                        problems.append(f"{slot.name}: {call}: **{expr} cannot be read statically; read it "
                                        "and add it to contracts.OPAQUE_OK with the reason it is safe")
        report += [f"{slot.name}: {c}" for c in calls]
    attention = _read(root, "transformer/attention.py")
    problems += [f"qkv buffer: {p}" for p in qkv_buffer_problems(attention)]
    report.append("qkv buffer: SelfAttention.get_query_key_value_tensors(h, None, split_qkv=False) returns "
                  "mixed_qkv [s, b, ng, (np/ng + 2) * hn] before anything is applied to q, k or v")
    return version, problems, report


# ------------------------------------------------------------------------------ what we call
#: what megatron's ``get_query_key_value_tensors`` may read before it returns the unsplit
#: buffer: the projection and the shapes (``world_size``/``pg_collection``: the TP gather,
#: which FusedRopeSelfAttention refuses)
_QKV_BUFFER_READS = frozenset({"linear_qkv", "num_query_groups_per_partition", "num_attention_heads_per_partition",
                               "hidden_size_per_attention_head", "config", "world_size", "pg_collection"})
_QKV_GATHER_TEST = "self.config.num_query_groups < self.world_size"


def qkv_buffer_problems(source: str) -> List[str]:
    """What ``FusedRopeSelfAttention`` relies on when it calls megatron's
    ``SelfAttention.get_query_key_value_tensors(hidden_states, None, split_qkv=False)`` and reads
    q, k, v from the result itself (``source``: that version's transformer/attention.py):

    - the call binds;
    - it returns ``mixed_qkv, split_arg_list`` under ``if not split_qkv``, after
      ``mixed_qkv = mixed_qkv.view(*new_tensor_shape)`` with ``new_tensor_shape`` =
      ``mixed_qkv.size()[:-1] + (self.num_query_groups_per_partition, <n> * self.hidden_size_per_attention_head)``;
    - ``split_arg_list`` is (q of the group, one key head, one value head) in that order;
    - nothing before the return touches q or k (a norm, test_mode's checks, RoPE): only the
      projection and shapes are read; the TP gather (``num_query_groups < world_size``) is the
      one branch, which the caller refuses, and ``Attention.__init__`` sets ``self.world_size``
      where it is read.
    """
    fn = parse_function(source, "SelfAttention", "get_query_key_value_tensors")
    if fn is None:
        return ["SelfAttention.get_query_key_value_tensors not found"]
    out = []
    try:
        signature_from_ast(fn).bind("hidden_states", None, split_qkv=False)
    except TypeError as e:
        out.append(f"(hidden_states, None, split_qkv=False) does not bind: {e}")
    ret = next((n for n in ast.walk(fn) if isinstance(n, ast.If) and ast.unparse(n.test) == "not split_qkv"
                and any(isinstance(b, ast.Return) and ast.unparse(b.value) == "(mixed_qkv, split_arg_list)"
                        for b in n.body)), None)
    if ret is None:
        return out + ["no `if not split_qkv: return (mixed_qkv, split_arg_list)`"]
    path: List[ast.stmt] = []
    if not _run_to(fn.body, ret, path, out):
        return out + ["the `return mixed_qkv, split_arg_list` is not reached with output_gate=False"]
    before = [n for st in path for n in ast.walk(st)]
    texts = {ast.unparse(n) for n in before if isinstance(n, ast.Assign)}
    if "mixed_qkv = mixed_qkv.view(*new_tensor_shape)" not in texts:
        out.append("mixed_qkv is not viewed as new_tensor_shape before the return")
    shapes = [n.value for n in before if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "new_tensor_shape"]
    ok = (len(shapes) == 1 and isinstance(shapes[0], ast.BinOp) and isinstance(shapes[0].right, ast.Tuple)
          and ast.unparse(shapes[0].left) == "mixed_qkv.size()[:-1]" and len(shapes[0].right.elts) == 2
          and ast.unparse(shapes[0].right.elts[0]) == "self.num_query_groups_per_partition"
          and ast.unparse(shapes[0].right.elts[1]).endswith("* self.hidden_size_per_attention_head"))
    if not ok:
        out.append(f"new_tensor_shape is not [s, b, ng, n * hn]: {[ast.unparse(x) for x in shapes]}")
    lists = [n.value for n in before if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "split_arg_list"
             and isinstance(n.value, ast.List)]
    if not lists or len(lists[-1].elts) != 3 or any(ast.unparse(e) != "self.hidden_size_per_attention_head"
                                                     for e in lists[-1].elts[1:]):
        out.append(f"split_arg_list is not [q heads * hn, hn, hn]: {[ast.unparse(x) for x in lists]}")
    reads = {n.attr for n in before if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
             and n.value.id == "self"}
    if reads - _QKV_BUFFER_READS:
        out.append(f"reads {sorted(reads - _QKV_BUFFER_READS)} before returning the buffer")
    if any(ast.unparse(n.test) == _QKV_GATHER_TEST for n in ast.walk(fn) if isinstance(n, ast.If)):
        init = parse_function(source, "Attention", "__init__")
        if init is None or "self.world_size = " not in ast.unparse(init):
            out.append("get_query_key_value_tensors branches on self.world_size but Attention.__init__ does not set it")
    return out


def _run_to(stmts: Sequence[ast.stmt], target: ast.stmt, path: List[ast.stmt], out: List[str]) -> bool:
    """The statements FusedRopeSelfAttention's call runs before ``target`` (appended to ``path``):
    ``if output_gate`` takes its else (the call passes no gate), the TP gather is skipped (the
    caller refuses it); any other branch is a problem (``out``). True when ``target`` is reached."""
    for st in stmts:
        if st is target:
            return True
        if isinstance(st, ast.If):
            test = ast.unparse(st.test)
            if test == "output_gate":
                if _run_to(st.orelse, target, path, out):
                    return True
                continue
            if test == _QKV_GATHER_TEST:
                continue
            out.append(f"a branch before the buffer is returned: `if {test}`")
        path.append(st)
    return False


# ------------------------------------------------------------------------------ where the sources are
def installed_root() -> Optional[str]:
    """The directory holding the importable ``megatron/`` (None without megatron-core)."""
    try:
        spec = importlib.util.find_spec("megatron.core")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    return os.path.dirname(os.path.dirname(os.path.dirname(spec.origin)))


def sources_dir() -> str:
    return os.environ.get(SOURCES_ENV) or os.path.join(sys.prefix, "sources")


def source_roots(versions: Iterable[str]) -> Dict[str, Optional[str]]:
    """``version -> <sources>/megatron-core-<version>`` (None where it is not unpacked)."""
    out = {}
    for v in versions:
        path = os.path.join(sources_dir(), f"megatron-core-{v}")
        out[v] = path if os.path.isfile(os.path.join(path, "megatron", "core", "package_info.py")) else None
    return out


def pinned_versions(requirements: str) -> List[str]:
    """The ``megatron-core==X`` versions of a requirements file (requirements/sources/)."""
    out = []
    with open(requirements, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line.startswith("megatron-core=="):
                out.append(line.split("==", 1)[1].split()[0].rstrip("\\").strip())
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    roots = list(argv if argv is not None else sys.argv[1:]) or [installed_root()]
    bad = 0
    for root in roots:
        version, problems, report = check(root)
        print(f"megatron-core {'.'.join(map(str, version))} ({root})")
        for line in report:
            print(f"  {line}")
        for p in problems:
            print(f"  PROBLEM {p}")
        bad += len(problems)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
