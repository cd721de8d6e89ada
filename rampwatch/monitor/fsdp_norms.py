"""FSDP2 (`torch.distributed.fsdp.fully_shard`): the squared norms of this rank's own gradient
that the noise scale needs, where FSDP2 keeps them.

Owns: `fsdp2_modules` (the FSDPModules of a model, compiled or wrapped), `Fsdp2Norms` (attach:
a reduce-scatter that takes |input|² before the op it wraps, on every FSDPModule; `take()`,
`unsharded_sq()`, `shard_sq()`) and `_unsharded_grads`, the one read of torch's internals.
gradstats.py turns these into the noise scale's points (its docstring: which points, why).

Three figures, all on the device, none synchronized with the host:
- the local full gradient a backward reduce-scatters: `FSDPModule.set_custom_reduce_scatter`
  (public API) gets a comm that adds |input_tensor|² and then calls the comm it replaced. Its
  input is this rank's unsharded gradients of the group, each zero-padded to a multiple of the
  world size (`foreach_reduce_scatter_copy_in`, `torch._chunk_cat`), so its squared norm is the
  local gradient's. FSDP2 pre-divides that input only for reduce dtypes other than float32 and
  bfloat16 (torch 2.13 _fsdp_collectives.py `_get_gradient_divide_factors`, `overflow_risk`):
  for those the comm only notes it, and nothing is measured. It runs once per parameter
  group, in FSDP2's reduce-scatter stream, inside backward(); `take()` makes the current stream
  wait for it (an event, no host sync) and records the sum on that stream before it is read.
- between backwards that do not sync (`set_requires_gradient_sync(False)`), this rank's
  accumulated unsharded gradients: only torch's internals hold them (`_unsharded_grads`).
- after a backward that syncs, the sharded `.grad` (a DTensor): |.grad.to_local()|² summed over
  ranks is |.grad|², since a squared norm is the sum of its shards' (one all-reduce, in
  gradstats' collect, with the other values of the step).
Only a 1-D mesh over the whole world is measured: under HSDP or tensor parallelism the shards
repeat over replicas, or the unsharded gradient is itself a shard.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as torch_dist

# FSDP2 reduce-scatters these dtypes without dividing its input first (see the docstring)
_UNDIVIDED = (torch.float32, torch.bfloat16)


def fsdp2_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every FSDPModule in the model (fully_shard's FSDP<Module> classes); [] without any.
    model.modules() reaches them under a torch.compile wrapper or a DDP-like wrapper too."""
    # a model holds FSDPModules only once the package is loaded (importing it costs seconds)
    fsdp = sys.modules.get("torch.distributed.fsdp")
    module_class = getattr(fsdp, "FSDPModule", None)
    if module_class is None:
        return []
    return [m for m in model.modules() if isinstance(m, module_class)]


class _NormReduceScatter:
    """FSDP2's reduce-scatter comm (the `ReduceScatter` interface: allocate, __call__): this
    rank's |input|² added to its Fsdp2Norms, then the comm it replaced, unchanged."""

    def __init__(self, norms: "Fsdp2Norms", inner) -> None:
        self.norms = norms
        self.inner = inner.inner if isinstance(inner, _NormReduceScatter) else inner

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.inner is not None:
            return self.inner.allocate(size, dtype=dtype, device=device)
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        self.norms._add(input_tensor)
        if self.inner is not None:
            return self.inner(
                output_tensor=output_tensor,
                input_tensor=input_tensor,
                group=group,
                op=op,
                async_op=async_op,
            )
        return torch_dist.reduce_scatter_single(  # what FSDP2's DefaultReduceScatter calls
            output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op
        )


class Fsdp2Norms:
    """This rank's gradient norms of an FSDP2 model. Build it with `attach(model)`, which says
    why it cannot be measured instead (a string) where it cannot."""

    def __init__(self, modules: list[torch.nn.Module], params: list[torch.Tensor], world: int):
        self.modules = modules
        self.params = params  # the sharded parameters (DTensors) whose .grad is a shard
        self.world = world  # ranks of the mesh, all of the job's
        self._sq: torch.Tensor | None = None
        self._ready = None  # CUDA: the event after the last norm, on the reduce-scatter stream
        self.undivided = True  # False once a reduce-scatter's input was pre-divided
        self.failed = ""  # the error of a norm the reduce-scatter could not take

    @classmethod
    def attach(cls, model: torch.nn.Module, world: int) -> "Fsdp2Norms | str":
        modules = fsdp2_modules(model)
        params = [p for p in model.parameters() if p.requires_grad]
        why = _unmeasured_mesh(params, world)
        if why:
            return why
        norms = cls(modules, params, world)
        for module in modules:
            try:
                inner = _current_reduce_scatter(module)
                module.set_custom_reduce_scatter(_NormReduceScatter(norms, inner))
            except ValueError as e:  # several parameter groups per module (per-param meshes)
                return f"FSDP2 refused a custom reduce-scatter: {e}"
        return norms

    def _add(self, flat: torch.Tensor) -> None:
        """Inside FSDP2's backward: never raises (an error there would stop the training)."""
        if flat.dtype not in _UNDIVIDED:
            self.undivided = False
            return
        try:
            sq = torch.linalg.vector_norm(flat, dtype=torch.float32).square()
            self._sq = sq if self._sq is None else self._sq + sq
            if flat.is_cuda:  # FSDP2's reduce-scatter stream: take() waits for this on its own
                self._ready = torch.cuda.current_stream(flat.device).record_event()
        except Exception as e:  # said by gradstats as the reason nothing is measured
            self.failed = self.failed or f"{type(e).__name__}: {e}"

    def take(self) -> torch.Tensor | None:
        """|local gradient|² the reduce-scatters saw since the last take(); None: none ran."""
        value, self._sq, ready, self._ready = self._sq, None, self._ready, None
        if value is not None and value.is_cuda:
            # made on FSDP2's reduce-scatter stream, read (and freed) on this one: a wait on
            # the device, not the host (also where set_is_last_backward(False) skips FSDP2's)
            stream = torch.cuda.current_stream(value.device)
            if ready is not None:
                stream.wait_event(ready)
            value.record_stream(stream)
        return value

    def unsharded_sq(self, squared_norm) -> torch.Tensor | None:
        """|this rank's accumulated unsharded gradient|² between backwards that do not sync;
        None when there is none (the last backward synced) or torch's internals moved."""
        try:
            grads = _unsharded_grads(self.modules)
        except Exception:  # torch's internals moved (AttributeError, most likely): say so
            return None
        return squared_norm(grads) if grads else None

    def shard_sq(self, squared_norm) -> torch.Tensor | None:
        """|this rank's shard of .grad|²: summed over ranks, |.grad|² (None: no .grad)."""
        grads = [p.grad.to_local() for p in self.params if p.grad is not None]
        return squared_norm(grads) if grads else None


def _unmeasured_mesh(params: list[torch.Tensor], world: int) -> str | None:
    for p in params:
        mesh = getattr(p, "device_mesh", None)
        if mesh is None:
            continue
        if mesh.ndim != 1:
            return (
                f"FSDP2 on a {mesh.ndim}-D device mesh (HSDP or tensor parallel): a rank's "
                "gradient is itself a shard, or its shards repeat over replicas"
            )
        if mesh.size() != world:
            return f"FSDP2 shards over {mesh.size()} of the job's {world} ranks"
    return None


def _current_reduce_scatter(module):
    """The comm each parameter group reduce-scatters with now (FSDP2's DefaultReduceScatter
    unless the loop set its own), so the monitor's wraps it instead of replacing it. torch 2.13:
    _fsdp_param_group.py FSDPParamGroup.__init__ (`self._reduce_scatter_comm`, line 203). None
    (the monitor then calls reduce_scatter_single, as the default does) where that is gone."""
    try:
        groups = module._get_fsdp_state()._fsdp_param_groups
        comms = {id(g._reduce_scatter_comm): g._reduce_scatter_comm for g in groups}
    except AttributeError:
        return None
    return next(iter(comms.values())) if len(comms) == 1 else None


def _unsharded_grads(modules) -> list[torch.Tensor]:
    """This rank's accumulated unsharded gradients after a backward that did not sync.

    torch 2.13, torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py FSDPParamGroup
    .post_backward (lines 603-612): with `reduce_grads` False (set_requires_gradient_sync(False))
    it accumulates and returns, leaving each FSDPParam's gradient in `unsharded_accumulated_grad`
    (a reduce dtype other than the parameter's, _fsdp_param.py lines 802-821) or else in
    `_unsharded_param.grad`; the next backward that syncs reduce-scatters and clears both
    (post_backward lines 618-630). Reads only; AttributeError where these names are gone (the
    caller then measures nothing and says why).
    """
    out = []
    for module in modules:
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                acc = fsdp_param.unsharded_accumulated_grad
                param = getattr(fsdp_param, "_unsharded_param", None)  # made at lazy init
                grad = None if param is None else param.grad
                if acc is not None and grad is not None:  # not yet folded in: their sum
                    out.append(acc + grad.to(acc.dtype))
                elif acc is not None or grad is not None:
                    out.append(acc if acc is not None else grad)
    return out
