"""Code that runs inside vLLM's own processes (its engine core and its model workers).

Two pieces, both light to import (vLLM loads them in every process it starts):

- `LibraWorkerExtension`, the `worker_extension_cls` of Libra's vLLM engines: the methods the
  backend calls by name over `collective_rpc` to load pushed tensors into the served model and to
  hash what the model now serves, by the trainer's tensor names (vLLM fuses q/k/v and gate/up).

- `libra_engine_process`, a vLLM general plugin (entry point `vllm.general_plugins`): in a process
  started for a Libra engine (`LIBRA_VLLM_ENGINE=1` in its environment) it watches the parent and
  kills itself when the parent is gone, so a rollout-engine service killed with `kill -9` leaves no
  vLLM process holding the machine's memory; on CPU it keeps the linear weights loadable.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from typing import Any

ENGINE_ENV = "LIBRA_VLLM_ENGINE"
"""Set (to 1) in the environment of a Libra engine's vLLM processes; the plugin acts only there."""
POLL_S = 0.5


def libra_engine_process() -> None:
    """vLLM's general plugin: in the processes of a Libra engine, follows the parent and, on CPU,
    keeps the linear weights beside their packed kernels (so pushes can load into them)."""
    if os.environ.get(ENGINE_ENV) != "1" or getattr(libra_engine_process, "done", False):
        return
    libra_engine_process.done = True  # type: ignore[attr-defined]
    _follow_parent()
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        _keep_cpu_weights()


def _follow_parent() -> None:
    """A daemon thread that SIGKILLs this process once its parent has exited."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="libra-follow-parent", daemon=True).start()


def _keep_cpu_weights() -> None:
    """vLLM's CPU build packs each linear layer's weight for oneDNN and frees the tensor, which
    leaves nothing a new version can be loaded into. Libra's engines keep it (the model's linear
    weights twice in host memory) and re-pack after each push (`libra_finish_update`)."""
    from vllm.model_executor.layers import utils

    packing = utils.dispatch_cpu_unquantized_gemm

    def keep(layer: Any, remove_weight: bool) -> None:
        packing(layer, remove_weight=False)

    utils.dispatch_cpu_unquantized_gemm = keep


class LibraWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`): `self.model_runner` is vLLM's."""

    model_runner: Any

    vllm_config: Any

    def libra_load_weights(self, items: list[tuple[str, str, list[int], bytes]]) -> int:
        """Loads whole tensors (name, wire dtype, shape, raw bytes: what crosses vLLM's RPC as is)
        by their Hugging Face names; the model maps them onto its own fused layout
        (`load_weights`). Returns how many were loaded."""
        import torch
        from vllm.config import set_current_vllm_config

        from services.common.weights import torch_dtype

        tensors = [
            (name, torch.frombuffer(bytearray(data), dtype=torch_dtype(dtype)).view(*shape))
            for name, dtype, shape, data in items
        ]
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.get_model().load_weights(weights=tensors)
        return len(tensors)

    def libra_finish_update(self) -> None:
        """After a push: on CPU, packs the loaded linear weights for oneDNN again (the kernels hold
        packed copies of the old ones); on GPUs the weights were loaded where the kernels read."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        from vllm.model_executor.layers import utils

        for module in self.model_runner.get_model().modules():
            weight = getattr(module, "weight", None)
            if (
                hasattr(module, "cpu_linear")
                and not getattr(module, "_cpu_skip_gemm_dispatch", False)
                and weight is not None
                and weight.dim() == 2
                and weight.numel() > 0
            ):
                utils.dispatch_cpu_unquantized_gemm(module, remove_weight=False)

    def libra_resolves(self, specs: list[tuple[str, list[int]]]) -> bool:
        """True when every named tensor has a place in this model that records can write into."""
        views = _hf_views(self.model_runner.get_model())
        return all((v := views(name, shape)) is not None and v.is_contiguous() for name, shape in specs)

    def libra_write_records(
        self, records: list[tuple[str, list[int], str, int, int, bytes, int, bytes]]
    ) -> int:
        """Writes push records into the served tensors in place, by Hugging Face name (the rows of
        a fused tensor where vLLM fuses): (name, shape, wire dtype, offset, count, sparse indices,
        index bytes, values). A dense record fills `count` elements from `offset`; a sparse one
        the elements its indices list. Raises ValueError for a record that does not fit."""
        import torch

        from services.common.weights import record_indices, torch_dtype

        views = _hf_views(self.model_runner.get_model())
        for name, shape, dtype, offset, count, indices, index_bytes, data in records:
            view = views(name, shape)
            if view is None or not view.is_contiguous():
                raise ValueError(f"{name} {shape} has no place in this model")
            flat = view.view(-1)
            values = torch.frombuffer(bytearray(data), dtype=torch_dtype(dtype))
            with torch.no_grad():
                if indices:
                    idx = record_indices(indices, index_bytes, offset)
                    if idx.numel() != count or int(idx.min()) < 0 or int(idx.max()) >= flat.numel():
                        raise ValueError(f"sparse indices outside {name}")
                    flat[idx] = values.to(flat.dtype)
                else:
                    if offset < 0 or offset + count > flat.numel():
                        raise ValueError(f"elements past the end of {name}")
                    flat[offset : offset + count].copy_(values)
        return len(records)

    def libra_served_checksum(self, specs: list[tuple[str, list[int], str]]) -> str | None:
        """sha256 of the served tensors named by `specs` (name, shape, wire dtype), in order, each
        converted to its wire dtype, as the trainer hashes what it pushes. None when a name has no
        view here (an architecture whose fused layout is not q/k/v- or gate/up-style)."""
        import torch

        from services.common.weights import torch_dtype

        views = _hf_views(self.model_runner.get_model())
        h = hashlib.sha256()
        for name, shape, dtype in specs:
            view = views(name, shape)
            if view is None:
                return None
            wire = torch_dtype(dtype)
            piece = view.detach().reshape(-1)
            if piece.dtype != wire:
                piece = piece.to(wire)
            h.update(piece.contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


def _hf_views(model: Any) -> Any:
    """A lookup from a Hugging Face tensor name and shape to the tensor (or the rows of a fused
    tensor) that holds it in the vLLM model, or None."""
    params = dict(model.named_parameters(remove_duplicate=False))
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})

    def lookup(name: str, shape: list[int]) -> Any:
        found = _find(name, shape)
        return None if found is None or found.numel() != _numel(shape) else found

    def _find(name: str, shape: list[int]) -> Any:
        if name in params and list(params[name].shape) == list(shape):
            return params[name]
        for fused, parts in packed.items():
            for i, part in enumerate(parts):
                marker = f".{part}."
                if marker not in name:
                    continue
                fused_name = name.replace(marker, f".{fused}.")
                module_name, _, leaf = fused_name.rpartition(".")
                if (
                    fused_name not in params
                    or params[fused_name].dim() == 0
                    or params[fused_name].numel() == 0
                ):
                    return None
                module = model.get_submodule(module_name)
                sizes = list(getattr(module, "output_sizes", []) or [])
                if len(sizes) != len(parts):
                    return None
                start = sum(sizes[:i])
                rows = params[fused_name].narrow(0, start, sizes[i])
                return rows if list(rows.shape) == list(shape) else None
        if name in params:  # padded (a vocabulary rounded up): the rows the trainer has
            p = params[name]
            if p.dim() == len(shape) and p.shape[0] >= shape[0] and list(p.shape[1:]) == list(shape[1:]):
                return p.narrow(0, 0, shape[0])
        return None

    return lookup


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
