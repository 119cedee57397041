"""nemo_ssa/tools/step_profile.py on CPU: every op's time lands on one owner (nothing lost or
counted twice), a module's backward is found through the forward op's sequence number, layer
indices fold, and the optimizer step is its own row."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from nemo_ssa.tools import step_profile as sp


class _Layer(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.input_layernorm = torch.nn.LayerNorm(h)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.ReLU(), torch.nn.Linear(4 * h, h))

    def forward(self, x):
        return x + self.mlp(self.input_layernorm(x))


class _Model(torch.nn.Module):
    def __init__(self, h=32, vocab=50):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, h)
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([_Layer(h), _Layer(h)])
        self.output_layer = torch.nn.Linear(h, vocab)

    def forward(self, tokens):
        x = self.embedding(tokens)
        for layer in self.decoder.layers:
            x = layer(x)
        return self.output_layer(x)


def _profiled_step():
    torch.manual_seed(0)
    model = _Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 50, (4, 16))
    with sp.module_ranges(model):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            loss.backward()
            with sp.optimizer_range():
                opt.step()
    return model, prof.events()


def test_every_op_has_one_owner_and_backward_finds_its_module():
    model, events = _profiled_step()
    owners = sp.by_module(events, device=False)
    total = sum(float(e.self_cpu_time_total) for e in events)
    assert abs(sum(owners.values()) - total) <= 1e-6 * total + 1e-3
    for name in ("embedding", "decoder.layers.*.input_layernorm", "decoder.layers.*.mlp", "output_layer"):
        assert owners.get(f"{name} fwd", 0) > 0, (name, owners)
    for name in ("decoder.layers.*.mlp", "output_layer", "decoder.layers.*.input_layernorm"):
        assert owners.get(f"{name} bwd", 0) > 0, (name, owners)
    assert owners.get("optimizer", 0) > 0
    assert not any(".0." in k or ".1." in k for k in owners), owners  # the two layers fold into one row
    # the hooks are gone after the block
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_without_ranges_nothing_is_attributed_to_a_module():
    torch.manual_seed(0)
    model = _Model()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(torch.randint(0, 50, (2, 8))).sum().backward()
    owners = sp.by_module(prof.events(), device=False)
    assert set(owners) <= {"other", "backward, no module"}, owners


def test_families_and_table():
    assert sp.family("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert sp.family("_attn_fwd_kernel") == "attention"
    assert sp.family("triton_poi_fused__to_copy_transpose_0") == "copy/transpose/cast"
    assert sp.family("triton_poi_fused_cat_clone_view_12") == "copy/transpose/cast"
    # megatron's compiled cross entropy fuses casts with its reductions: not a layout copy
    assert sp.family("triton_per_fused__to_copy_max_0") == sp.COMPILED
    assert sp.family("cpp_fused_copy__div_log_split_sub_unsqueeze_0") == sp.COMPILED
    assert sp.family("triton_red_fused__log_softmax_3") == sp.COMPILED
    assert sp.family("vectorized_layer_norm_kernel") == "norm"
    assert sp.family("multi_tensor_apply_kernel") == "optimizer"
    assert sp.family("something_else") == "other"
    assert sp.family("relu2_fwd_kernel") == sp.family("relu2_bwd_kernel_du") == "gemm"  # not "relu"
    assert sp.family("void at::native::GammaBetaBackwardCUDAKernel<c10::BFloat16>") == "norm"
    assert sp.family("layernorm_bwd_kernel") == "norm"
    assert sp.family("_rope_layout_kernel") == "rope + layout"
    _, events = _profiled_step()
    fams = sp.by_family(events, device=False)
    assert fams.get("gemm", 0) > 0 and fams.get("optimizer", 0) > 0, fams
    text = sp.table({"a fwd": 30.0, "b bwd": 10.0}, "module", steps=2)
    assert "| a fwd | 15 | 75.0 % |" in text and "| total | 20 | |" in text


def test_the_nemo_profiler_callback_writes_the_step_by_module(tmp_path):
    from types import SimpleNamespace

    from nemo_ssa.nemo.callbacks import ProfilerCallback

    torch.manual_seed(0)
    model = _Model()
    cb = ProfilerCallback(str(tmp_path), start=1, num_steps=2, with_stack=False)
    trainer = SimpleNamespace(global_step=1)
    for _ in range(3):
        cb.on_train_batch_start(trainer, model, None, 0)
        model(torch.randint(0, 50, (2, 8))).sum().backward()
        trainer.global_step += 1
        cb.on_train_batch_end(trainer, model, None, None, 0)
    where = (tmp_path / "profile" / "where.md").read_text()
    assert "over 2 profiled steps" in where and "| decoder.layers.*.mlp bwd |" in where, where
    assert "| kernel family |" in where
    assert "What the rows without a module hold" in where and "| other | `" in where, where
    assert all(not m._forward_pre_hooks for m in model.modules())  # the ranges are removed


def test_device_time_counts_each_kernel_once_on_the_op_that_launched_it():
    """Device mode: a module's time is the kernels its ops launched. prof.events() also lists
    the kernels as events of their own, whose self device time must not be added again."""
    from types import SimpleNamespace as NS

    def op(name, seq, kernels, parent=None, self_dev=0.0):
        return NS(name=name, sequence_nr=seq, thread=1, cpu_parent=parent, kernels=[NS(name=k, duration=d) for k, d in kernels],
                  self_device_time_total=self_dev, self_cpu_time_total=1.0, id=id(name) + seq)

    rng = op(f"{sp.MODULE_RANGE}decoder.layers.0.mlp", -1, [])
    mm = op("aten::mm", 7, [("sm90_xmma_gemm", 40.0)], parent=rng, self_dev=40.0)
    copy = op("aten::copy_", 8, [("elementwise_copy", 10.0)], parent=rng, self_dev=10.0)
    kernel_event = op("sm90_xmma_gemm", -1, [], self_dev=40.0)  # the device-side event itself
    events = [rng, mm, copy, kernel_event]
    owners = sp.by_module(events, device=True)
    assert sum(owners.values()) == 50.0 == sum(sp.by_family(events, device=True).values())


def test_top_ops_name_what_the_unnamed_rows_hold():
    from types import SimpleNamespace as NS

    def op(name, seq, kernels, parent=None):
        return NS(name=name, sequence_nr=seq, thread=1, cpu_parent=parent,
                  kernels=[NS(name=k, duration=d) for k, d in kernels], self_cpu_time_total=1.0)

    rng = op(f"{sp.MODULE_RANGE}decoder.layers.0.mlp", -1, [])
    inside = op("aten::mm", 7, [("sm90_xmma_gemm", 40.0)], parent=rng)
    loose = [op("aten::copy_", 8, [("elementwise_copy_kernel", 6.0)]),
             op("aten::copy_", 9, [("elementwise_copy_kernel", 4.0)]),
             op("aten::mul", 10, [("vectorized_elementwise_kernel", 3.0)])]
    tops = sp.top_ops([rng, inside, *loose], device=True)
    assert tops == {"other": [("aten::copy_", "copy/transpose/cast", 10.0), ("aten::mul", "elementwise", 3.0)]}
    text = sp.top_ops_table(tops, steps=2)
    assert "| other | `aten::copy_` | copy/transpose/cast | 5 |" in text
    # the CPU path: a real step's unnamed ops are found, and nothing inside a module is listed
    _, events = _profiled_step()
    cpu = sp.top_ops(events, device=False, owners=("other",), n=3)
    assert cpu and len(cpu["other"]) <= 3 and all(t > 0 for _, _, t in cpu["other"])


def test_top_kernels_say_which_kernels_make_up_the_step():
    """The largest (kernel, owner) pairs by device time, with launch counts: a family total
    alone cannot say which kernels it was (2026-11-29: "elementwise" was 15 % of the step)."""
    from types import SimpleNamespace as NS

    def op(name, seq, kernels, parent=None):
        return NS(name=name, sequence_nr=seq, thread=1, cpu_parent=parent,
                  kernels=[NS(name=k, duration=d) for k, d in kernels], self_cpu_time_total=1.0)

    mlp = op(f"{sp.MODULE_RANGE}decoder.layers.*.mlp", -1, [])  # module_ranges folds layer indices
    ln = op(f"{sp.MODULE_RANGE}decoder.layers.*.input_layernorm", -1, [])
    events = [mlp, ln,
              op("aten::mm", 7, [("sm90_xmma_gemm", 40.0)], parent=mlp),
              op("aten::add", 8, [("vectorized_elementwise_kernel", 5.0)], parent=mlp),
              op("aten::native_layer_norm", 9, [("vectorized_layer_norm_kernel", 12.0)], parent=ln),
              op("aten::add", 10, [("vectorized_elementwise_kernel", 7.0)]),
              op("aten::add", 11, [("vectorized_elementwise_kernel", 9.0)])]
    top = sp.top_kernels(events, n=3)
    assert top == [("sm90_xmma_gemm", "gemm", "decoder.layers.*.mlp fwd", 40.0, 1),
                   ("vectorized_elementwise_kernel", "elementwise", "other", 16.0, 2),
                   ("vectorized_layer_norm_kernel", "norm", "decoder.layers.*.input_layernorm fwd", 12.0, 1)]
    assert sum(t for *_, t, _ in sp.top_kernels(events)) == sum(sp.by_family(events, device=True).values())
    text = sp.top_kernels_table(top, steps=2, width=20)
    assert "| `vectorized_elemen...` | elementwise | other | 8 | 1.0 |" in text, text
    assert "| `sm90_xmma_gemm` | gemm | decoder.layers.*.mlp fwd | 20 | 0.5 |" in text, text


def test_under_cuda_graphs_the_profile_has_no_module_ranges(tmp_path):
    """model.cuda_graphs=local: megatron refuses forward pre-hooks on a graphed layer, so the
    launcher asks for no module ranges; the kernel families and the trace are still written."""
    from types import SimpleNamespace

    from nemo_ssa.nemo.callbacks import ProfilerCallback

    torch.manual_seed(0)
    model = _Model()
    seen = []
    cb = ProfilerCallback(str(tmp_path), start=1, num_steps=1, with_stack=False, module_ranges=False)
    trainer = SimpleNamespace(global_step=1)
    for _ in range(2):
        cb.on_train_batch_start(trainer, model, None, 0)
        seen.append(sum(len(m._forward_pre_hooks) for m in model.modules()))
        model(torch.randint(0, 50, (2, 8))).sum().backward()
        trainer.global_step += 1
        cb.on_train_batch_end(trainer, model, None, None, 0)
    where = (tmp_path / "profile" / "where.md").read_text()
    assert seen == [0, 0] and "No module table" in where and "| kernel family |" in where, where
    assert (tmp_path / "profile" / "trace.json.gz").is_file()
