"""LoRA adapters on a running model: slots of adapter weights beside the base weights,
and the per-row low-rank update.

Each projection an adapter may update (q/k/v/o, gate/up/down; q/k/v and gate/up fused
into one layer where the backend fused them) is a `Site` holding, per slot, the adapter's
A of every part side by side, transposed (in x P * R), and each part's scaled B,
transposed, over the part's columns (R x out), R being `max_lora_rank` (a smaller rank
is zero padded). A forward hook on the site's layer adds, after the base matmul has run
once for every row of the step, each row's update from its own slot: h = x A^T, then
y[:, part] += h[:, part's R] B_part^T (on CPU the decode stack, which runs a decode step's
layers in one C++ call, makes the same update there). The step's rows by slot (`LoRAStep`) reach the
hooks on the step's metadata, as attention's do; a step without adapter rows pays one
attribute read per projection.

How the update runs is chosen once, when the slots are made (`LoRAModel`): on CPU in
float32 with the C++ kernels, one call a projection for all the step's adapter rows
(csrc/lora_update.cpp, as Punica's SGMV); elsewhere (CUDA, no compiler) plain torch, a
few calls per slot the step uses.

Loading reads and checks the whole adapter (config, tensors, every shape) before it
writes its slot; what does not fit is a LoRAAdapterError naming the adapter and the part,
and the slot keeps what it held.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from gristmill.errors import LoRAAdapterError
from gristmill.lora import TARGET_MODULES, AdapterConfig, LoRARequest, read_adapter_config, weight_file
from gristmill.model.context import get_metadata, has_metadata
from gristmill.model.layers.linear import GATE_UP, QKV

#: A decoder layer's projection, by the module names of every supported family.
_SITE_NAME = re.compile(r"(?:^|.*\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)")
#: A PEFT tensor name: (module path, layer index, projection, "A" or "B").
_TENSOR_NAME = re.compile(r"(?:base_model\.model\.)?(.*layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))"
                          r"\.lora_([AB])(?:\.default)?\.weight")
_FUSED = dict([QKV, GATE_UP])


@dataclass
class LoRAStep:
    """A step's adapter rows by slot. `groups`: (slot, rows) for each slot some row uses,
    rows a slice of the step's tokens where they are contiguous, else an index tensor on
    the model's device (the torch update's form). `rows`, `group_slots`, `group_starts`:
    the same as three int64 CPU tensors, the rows of group g being
    rows[group_starts[g]:group_starts[g + 1]] (the kernel's form)."""

    groups: list[tuple[int, slice | torch.Tensor]]
    rows: torch.Tensor
    group_slots: torch.Tensor
    group_starts: torch.Tensor


class Site:
    """One projection layer of the model as it runs (fused or not) and its slots."""

    def __init__(self, module: nn.Module, parts: tuple[str, ...], num_slots: int, rank: int, dtype, device,
                 update):
        self.module, self.parts, self.rank, self.update = module, parts, rank, update
        sizes = getattr(module, "split_sizes", None) or [module.out_features]
        starts = np.cumsum([0, *sizes])
        self.bounds = [(int(s), int(e)) for s, e in zip(starts[:-1], starts[1:])]
        self.split_points = [int(s) for s in starts]
        self.in_features, self.out_features = module.in_features, module.out_features
        # (slots, in, P * R): the parts' A^T side by side; (slots, R, out): each part's
        # B^T over its columns
        self.a = torch.zeros(num_slots, self.in_features, len(parts) * rank, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, rank, self.out_features, dtype=dtype, device=device)
        #: (slots, parts): the parts each slot's adapter updates (a part it does not is zero)
        self.parts_used = torch.zeros(num_slots, len(parts), dtype=torch.bool)
        #: Its update runs in the C++ kernels, so the CPU decode stack can run it too
        #: (csrc/decode_stack.cpp) instead of the layers' hooks.
        self.in_kernels = update is not torch_update
        module.register_forward_hook(self._hook)
        #: (for the decode stack, which runs the layer's kernel itself, hooks unseen)
        module.lora_site = self

    def _hook(self, module, args, output):
        if not has_metadata():
            return None
        step = get_metadata().lora
        if step is None:
            return None
        x = args[0].reshape(-1, self.in_features)  # (num_tokens, in)
        y = output.view(-1, self.out_features)  # (num_tokens, out), updated in place
        self.update(self, x, y, step)
        return output

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.parts_used[slot] = False

    def put(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Part `part`'s A (r, in) and scaled B (out_part, r) into `slot`."""
        r, (start, end) = a.shape[0], self.bounds[part]
        offset = part * self.rank
        self.a[slot, :, offset:offset + r] = a.t().to(self.a.dtype)
        self.b[slot, :r, start:end] = b.t().to(self.b.dtype)
        self.parts_used[slot, part] = True


def torch_update(site: Site, x: torch.Tensor, y: torch.Tensor, step: LoRAStep) -> None:
    """y += each slot's update on its rows, in torch: per slot, x[rows] A^T, then one
    matmul and add per part it updates."""
    rank, used = site.rank, site.parts_used.tolist()
    for slot, rows in step.groups:
        parts = [p for p, on in enumerate(used[slot]) if on]
        if not parts:
            continue
        h = x[rows] @ site.a[slot]  # (rows, P * R)
        for part in parts:
            start, end = site.bounds[part]
            delta = (h[:, part * rank:(part + 1) * rank] @ site.b[slot, :, start:end]).to(y.dtype)
            if isinstance(rows, slice):
                y[rows, start:end] += delta
            else:
                y[:, start:end].index_add_(0, rows, delta)


def kernel_update(ops):
    """y += every adapter row's update in one C++ call (CPU, float32)."""
    def update(site: Site, x: torch.Tensor, y: torch.Tensor, step: LoRAStep) -> None:
        ops.lora_update_(y, x, site.a, site.b, site.parts_used, step.rows, step.group_slots,
                         step.group_starts, site.split_points)
    return update


class LoRAModel:
    """The adapter slots of a model: `load(slot, lora)` fills one, `step_of` says which
    rows of a step use which slot."""

    def __init__(self, model: nn.Module, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.num_slots, self.max_rank, self.device = num_slots, max_rank, device
        ops = _cpu_kernels() if device.type == "cpu" and dtype == torch.float32 else None
        update = torch_update if ops is None else kernel_update(ops)
        #: (layer index, projection name as the checkpoint has it) -> (site, part index)
        self.parts: dict[tuple[int, str], tuple[Site, int]] = {}
        self.sites: list[Site] = []
        for name, module in model.named_modules():
            match = _SITE_NAME.fullmatch(name)
            if match is None or not hasattr(module, "in_features"):
                continue
            layer, proj = int(match.group(1)), match.group(2)
            parts = _FUSED.get(proj, (proj,))
            if not set(parts) <= set(TARGET_MODULES):
                continue
            site = Site(module, parts, num_slots, max_rank, dtype, device, update)
            self.sites.append(site)
            for i, part in enumerate(parts):
                self.parts[layer, part] = (site, i)
        self.num_layers = 1 + max((layer for layer, _ in self.parts), default=-1)
        #: Heads of q and k, whose B rows a llama LoRA GGUF holds in llama.cpp's rotary order.
        attention = next((m for m in model.modules() if hasattr(m, "num_kv_heads") and hasattr(m, "num_heads")),
                         None)
        self.rotary_heads = {} if attention is None else {"q_proj": attention.num_heads,
                                                          "k_proj": attention.num_kv_heads}

    def load(self, slot: int, lora: LoRARequest) -> None:
        """Put adapter `lora` in `slot` in place of what it held. Everything is read and
        checked first: an adapter that does not fit raises LoRAAdapterError and leaves
        the slot as it was."""
        if not self.sites:
            raise LoRAAdapterError(f"LoRA adapter {lora.lora_name!r}: this model has no layers an adapter can "
                                   f"update (q/k/v/o, gate/up/down projections of a decoder)", lora_name=lora.lora_name)
        config = read_adapter_config(lora, self.max_rank)
        tensors = _read_tensors(config)
        if config.gguf_arch == "llama":
            self._rotary_to_checkpoint_order(tensors)
        updates = self._updates(config, tensors)
        for site in self.sites:
            site.clear(slot)
        for (site, part), (a, b) in updates.items():
            site.put(slot, part, a, b)

    def _updates(self, config: AdapterConfig, tensors: dict[str, torch.Tensor]) -> dict:
        """(site, part) -> (A, scale * B) of every module the adapter updates, each checked
        against the model."""
        name, pairs = config.name, {}
        for key, tensor in tensors.items():
            match = _TENSOR_NAME.fullmatch(key)
            if match is None:
                raise LoRAAdapterError(f"LoRA adapter {name!r} has a tensor {key!r} that is not a LoRA A or B "
                                       f"matrix of a q/k/v/o or gate/up/down projection; it cannot run here",
                                       lora_name=name)
            module, layer, proj, which = match.group(1), int(match.group(2)), match.group(3), match.group(4)
            if proj not in TARGET_MODULES:
                raise LoRAAdapterError(f"LoRA adapter {name!r} updates {module}; adapters may update only "
                                       f"{list(TARGET_MODULES)}", lora_name=name)
            if (layer, proj) not in self.parts:
                raise LoRAAdapterError(f"LoRA adapter {name!r} updates {module}, which this model does not have "
                                       f"(it has {self.num_layers} layers): was it trained on another base model"
                                       f"{f' ({config.base_model})' if config.base_model else ''}?", lora_name=name)
            pairs.setdefault((module, layer, proj), {})[which] = tensor
        if not pairs:
            raise LoRAAdapterError(f"LoRA adapter {name!r} holds no LoRA weights", lora_name=name)
        updates = {}
        for (module, layer, proj), pair in pairs.items():
            if set(pair) != {"A", "B"}:
                raise LoRAAdapterError(f"LoRA adapter {name!r} has lora_{set(pair).pop()} of {module} without its "
                                       f"lora_{({'A', 'B'} - set(pair)).pop()}", lora_name=name)
            site, part = self.parts[layer, proj]
            start, end = site.bounds[part]
            a, b, r = pair["A"], pair["B"], config.rank_of(module)
            expected = {"A": (r, site.in_features), "B": (end - start, r)}
            for which, tensor in pair.items():
                if tuple(tensor.shape) != expected[which]:
                    raise LoRAAdapterError(
                        f"LoRA adapter {name!r}: {module}.lora_{which} has shape {tuple(tensor.shape)}, where this "
                        f"model (and the adapter's rank {r}) needs {expected[which]}; was it trained on another "
                        f"base model{f' ({config.base_model})' if config.base_model else ''}?", lora_name=name)
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise LoRAAdapterError(f"LoRA adapter {name!r}: {module} has values that are not finite",
                                       lora_name=name)
            updates[site, part] = (a, b.float() * config.scale_of(module))
        return updates

    def _rotary_to_checkpoint_order(self, tensors: dict[str, torch.Tensor]) -> None:
        """q's and k's B rows of a llama LoRA GGUF back in the checkpoint's order (llama.cpp's
        converter interleaves each head's two rotary halves, as in the model's own q and k)."""
        from gristmill.model.loader.gguf_model import unpermute_rotary

        for key, tensor in tensors.items():
            match = _TENSOR_NAME.fullmatch(key)
            heads = self.rotary_heads.get(match.group(3)) if match and match.group(4) == "B" else None
            if heads is not None and tensor.shape[0] % (2 * heads) == 0:
                tensors[key] = torch.from_numpy(unpermute_rotary(tensor.numpy(), heads))

    def step_of(self, slots: list[int], query_start: np.ndarray) -> LoRAStep | None:
        """The step's rows by slot, from each sequence's slot (-1: the base) and where its
        tokens start (`HostStep.query_start`); None when no row uses an adapter."""
        by_seq = np.asarray(slots, dtype=np.int64)
        if not (by_seq >= 0).any():
            return None
        by_token = np.repeat(by_seq, np.diff(query_start))
        groups, rows_of = [], []
        for slot in np.unique(by_seq[by_seq >= 0]).tolist():
            rows = np.flatnonzero(by_token == slot)
            rows_of.append(rows)
            if rows[-1] - rows[0] + 1 == len(rows):
                groups.append((slot, slice(int(rows[0]), int(rows[-1]) + 1)))
            else:
                groups.append((slot, torch.from_numpy(rows).to(self.device)))
        starts = np.cumsum([0, *map(len, rows_of)])
        return LoRAStep(groups, torch.from_numpy(np.concatenate(rows_of)),
                        torch.tensor([slot for slot, _ in groups], dtype=torch.int64), torch.from_numpy(starts))


def _cpu_kernels():
    """The C++ kernels (with lora_update_), or None: the torch update then runs."""
    from gristmill.model.cpu import kernels

    ops = kernels.fused_ops()
    return ops if ops is not None and hasattr(ops, "lora_update_") else None


def _read_tensors(config: AdapterConfig) -> dict[str, torch.Tensor]:
    path = weight_file(config)
    if config.gguf_arch is not None:
        from gristmill.lora_gguf import read_tensors
        return {key: torch.from_numpy(value) for key, value in read_tensors(config.name, path).items()}
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            tensors = load_file(str(path), device="cpu")
        else:
            tensors = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise ValueError("not a mapping of names to tensors")
    except Exception as exc:  # noqa: BLE001 - a damaged file fails only its adapter
        raise LoRAAdapterError(f"LoRA adapter {config.name!r}: {path} cannot be read ({type(exc).__name__}: "
                               f"{exc}); save the adapter again", lora_name=config.name) from None
    return tensors
