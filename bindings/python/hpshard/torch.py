"""hpshard.torch — ZeRO stage 2 / stage 3 data parallelism for a PyTorch ``nn.Module``.

::

    import hpshard, hpshard.torch as hpt

    world = hpt.world_from_env()                      # hpshard-run, torchrun, Open MPI, Slurm
    model = hpt.ShardedModule(net, world, stage=3, units=net.blocks,
                              optimizer="adamw", lr=1e-3, clip_max_norm=1.0)
    for x, y in data:
        loss = loss_fn(model(x), y)                   # this rank's mean over its samples
        loss.backward()
        model.step()                                  # replaces optimizer.step()

The module's parameters live in the engine's storage: its tensors are views of the
engine's memory (zero-copy, through the binding's NumPy views), and autograd adds
gradients straight into the engine's gradient storage. A hook on each parameter's gradient
accumulator checks the gradient in with the engine as soon as autograd has finished it, so
the reduce-scatters run while backward goes on. ``step()`` is the engine's step (SGD or
AdamW on this rank's shards, global-norm clipping and dynamic loss scaling folded in);
nothing in a step blocks the host.

Units are the submodules named in ``units`` (each transformer block, say; one unit inside
another is refused); every other parameter forms one more unit, the rest, and so does a
parameter used by two units (a submodule two blocks share, tied weights) or held both in a
unit and outside every unit (a block's layer its parent also keeps as an attribute of its
own). Stage 2 keeps every parameter resident: the first forward after a step waits for the
step's all-gathers, so the forward may read any parameter anywhere. With stage 3 only this
rank's shard of each unit is resident: a unit is gathered before its forward and released
after it, gathered again when the gradient of one of its outputs arrives in backward, and
released once its gradients are in (a unit holding a frozen parameter at the end of
backward, since autograd may still need the frozen weight after the trainable ones are
done). Outside a gathered unit its parameters hold no memory: each is its shape over one
element, a negative zero (stride 0), so reading one there gives zeros, not its values (the
DDP idiom ``out + 0 * sum(p.sum() for p in model.parameters())`` stays right); an operation
in a forward that keeps one for backward (a parent's ``F.linear(h, unit.weight)``, under
``torch.autocast`` too) raises, naming it, but a term computed from parameters after the
forward (an L2 penalty over ``model.parameters()``, an EMA) computes with the zeros unseen:
compute it inside the units' forwards, or evaluate inside :meth:`full_parameters`. A
parameter written in place after wrapping, or through ``p.data`` while released (a
``fill_``, ``zero_`` or ``nn.init.constant_`` between steps), raises at the next forward,
``step()``, ``state_dict()`` or save, naming it, as the write is lost (a write of -0.0
through ``p.data`` is not seen); a write that goes element by element (``nn.init.normal_``,
``uniform_``, ``mul_``, ``copy_``) raises at once there, in torch itself ("more than one
element of the written-to tensor refers to a single memory location": the released
parameter's one element), not in hpshard: initialise before wrapping, or load values with
``load_state_dict``; one
through ``p.data`` while its unit is gathered (``self.weight.data.clamp_()`` in the unit's
forward, an old-style constraint: use a parametrization) is lost unseen. A unit's module is
gathered before its first forward pre-hook and released after its last forward hook, so
hooks on it (``weight_norm``, ``spectral_norm``, a user's, registered before or after
wrapping, before the unit's forward begins) read its values; at stage 3 a forward hook
registered during the unit's forward, a global module pre-hook
(``register_module_forward_pre_hook``) and a full backward hook on it may run outside the
gather and read zeros (an operation there that keeps one for backward raises). A unit whose
parameters backward needs before a gradient reaches its outputs (a side loss it kept) is
gathered then. Tensors autograd saves for backward that are views of a gathered parameter
are saved as "this parameter, these strides" and re-derived from the re-gathered parameter
in backward, so activations never pin (or read stale) gathered memory; a unit that returns
its parameter, or a view of one, returns a copy (in lists, tuples, dicts and dataclasses).
A parameter written in place by a forward (``nn.Embedding(max_norm=...)``) raises at stage
3, where the release would lose the write. ``torch.utils.checkpoint`` may wrap units or run
inside them: a unit recomputed in backward is gathered for its backward (stage 3 recomputes
it over a copy of its parameters, so a kept graph stays right after the release; a
parameter used outside its unit inside a checkpointed region is not caught); with
``use_reentrant=True`` a parameter used by two checkpointed calls raises (each call
completes its gradient once; use ``use_reentrant=False``). Evaluation under
``torch.no_grad()`` or ``torch.inference_mode()`` between steps changes nothing. The wrapped
module, or a unit, called directly (``net(x)`` where ``model(x)`` belongs, as a DDP user may
keep the inner module) raises: only the ShardedModule's forward waits for the last step's
all-gathers and gathers the parameters outside every unit; inside :meth:`full_parameters`
it may be called under ``torch.no_grad()``. A backward
of a graph kept across ``step()`` (``retain_graph=True``) raises where it starts, before it
adds any gradient, as torch's version check refuses it after ``optimizer.step()``; a
forward given an output of a forward before the last ``step()`` (a recurrent state not
detached) goes on, and its backward raises where it starts. A graph from before the step
that a backward of this step's reaches part way (through a tensor computed from such an
output) raises there, with the step's gradients half checked in: the next backward and
``step()`` raise until ``load_state_dict(state_dict())`` starts afresh. At stage 2,
parameters read right after ``step()`` outside a forward (an EMA or teacher update) hold
the update only after ``synchronize()`` (or inside ``full_parameters()``): the step's
updates and all-gathers run on after it returns. A stage 3 forward gathers units with the
other ranks, so every rank runs it; to evaluate on some ranks only (rank 0 alone), do it
inside ``with model.full_parameters():``, which every rank enters.

Semantics, as DDP's: each rank takes the mean loss over its own samples and the engine
averages over the ranks and micro-batches once. A parameter registered twice (tied weights)
is one parameter. ``requires_grad=False`` parameters are frozen (never updated, no
gradient, still sharded). A trainable parameter that got no gradient in a backward is
checked in with a zero gradient at the end of it (torch.optim would skip it: AdamW's decay
and moments still advance here). At stage 3 the parameters left without one must be the
same on every rank, as with FSDP's and ZeRO-3's units: a unit's gradients are
reduce-scattered where its last one arrives, so a parameter only some ranks use (a branch
taken by the data, an expert given no tokens) makes the ranks' collectives differ, refused
as INVALID_ARGUMENT naming both calls where arguments are checked (CPU groups by default);
stage 2 takes it, as DDP's ``find_unused_parameters``. A backward that completes no
trainable parameter's gradient (``torch.autograd.grad``, ``backward(inputs=...)``) is not a
micro-batch: the engine does not see it. ``backward(create_graph=True)`` is a micro-batch
as a plain backward is: the engine takes its gradients' values, and ``p.grad`` keeps no
graph (for higher-order gradients take them with ``torch.autograd.grad(...,
create_graph=True)``). After a step's last backward ``p.grad`` is None at both stages: the
engine holds the gradients and reduces them across the ranks (inside ``no_sync()`` at stage
2 it is this rank's running sum, the engine's memory: read it, never write it); clip with
``clip_max_norm`` and read the global norm from ``grad_norm`` after ``step()``
(``torch.nn.utils.clip_grad_norm_`` over the parameters finds no gradient). Buffers
(BatchNorm's running statistics) stay each rank's own, as with DDP's
``broadcast_buffers=False``; ``state_dict()`` gives the calling rank's. The engine trains
the parameters it was created with: a parameter or submodule replaced, added or removed, a
parameter frozen or unfrozen, or its ``.data`` replaced, after wrapping makes the next
forward raise, naming what changed (change the module, then wrap it; set values through
``load_state_dict()``, or in place at stage 2 as below).

Writing parameters in place (under ``torch.no_grad()``) at stage 2: a float32 or frozen
parameter holds the write once :meth:`ShardedModule.synchronize` has returned after the last
``step()`` (or once its unit's next forward has begun); before that the step's all-gather may
still be writing it. A trainable float16 / bfloat16 parameter's values are the engine's
float32 master rounded at each step, so a write to it would be lost. The next forward,
``step()``, ``synchronize()``, ``state_dict()`` or ``close()`` raises once, naming the
parameter, for a write it sees in either case; a write through ``p.data`` is not seen (its
version counter is another tensor's). A checkpoint's save (``hpshard.Checkpoint.save`` on
``model.engine``) copies the parameters on a stream of its own after it returns: a write
after ``save()`` holds, and leaves the checkpoint alone, once :meth:`ShardedModule.synchronize`
has returned (or the next ``step()``'s forward has begun); one before that raises as above.

A backward that raises in the model's own code before any gradient checked in ends at
the next forward, and training goes on; one that raises after some did leaves the
engine's micro-batch half done, and the next backward or ``step()`` is refused.

Accumulation over micro-batches: pass ``accumulation_steps=k``; run the first k-1
backward passes inside ``with model.no_sync():`` and the last outside it, then
``step()``. A count that does not add up to k raises; a backward after the step's last
one raises FailedPreconditionError before it adds any gradient (call ``step()`` first),
and training goes on as if it had not been tried. A forward without a backward (a metric
computed with gradients enabled) may come before ``step()``.

``state_dict()`` (collective) returns full tensors keyed as the wrapped module's own
``state_dict()``; ``load_state_dict()`` (collective) loads parameters from rank 0's
dict into a fresh engine (optimizer state starts anew). A module holding a ShardedModule
saves and loads it the same way under its name (``"name." + key``). Both go through the engine's
``gather_parameter`` and initial views. To save and resume training with its optimizer
state, sharded and asynchronous, use ``hpshard.Checkpoint.create(model.engine, world,
root)`` (``save`` after ``step()``, ``load`` between steps, not inside
``full_parameters()``). Such a checkpoint holds the engine's state only: the parameters,
a tied parameter under its first name, and no buffers (each rank's own: save them, or what
rebuilds them, in ``metadata`` or a file of your own); ``hpshard-ckpt export`` writes the
same, so a plain module loads it with ``strict=False`` and re-ties its aliases.
``load_state_dict()`` replaces ``model.engine``: make the Checkpoint again after it.

Timeline: with HPS_TRACE=DIR each rank also writes its forward and backward spans per
unit (``torch-*.json``) beside the library's trace; ``hpshard-trace merge`` joins them.

CPU engines only (the engine's views are host memory there). Importing this module needs
torch; importing ``hpshard`` does not.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import copy
import dataclasses
import functools
import json
import os
import sys
import tempfile
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

import hpshard as _hps

__all__ = ["ShardedModule", "world_from_env", "wrapper_of"]

_MISSING = object()

# The open ShardedModule of each parameter, by id: (the parameter, weakly; the module,
# weakly). Kept here rather than on the parameter, which deepcopy and pickle would carry.
_OWNERS: Dict[int, Tuple[Any, Any]] = {}


def _owner_of(p: torch.Tensor) -> Optional["ShardedModule"]:
    entry = _OWNERS.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()


def wrapper_of(module: torch.nn.Module) -> Optional["ShardedModule"]:
    """The open ShardedModule that holds a parameter of ``module`` (wraps it, or a module
    holding it), else None. One dropped without ``close()`` stays open (its hooks on the
    module keep it alive) and a new ShardedModule over the module is refused: close it
    through this first (``wrapper_of(module).close()``, collective as ``close()`` is).
    Anything but a torch.nn.Module raises TypeError."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"wrapper_of: takes a torch.nn.Module, not {type(module).__name__}")
    for p in module.parameters():
        owner = _owner_of(p)
        if owner is not None and owner._engine is not None:
            return owner
    return None


def _fingerprint(t: torch.Tensor) -> int:
    """The sum of ``t``'s elements' bits read as integers: a write that changes it (through
    ``p.data`` too, which moves no version counter) shows. One read of the tensor."""
    if not t.numel():
        return 0
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return int(t.detach().reshape(-1).view(ints).sum(dtype=torch.int64))


def _inside_backward() -> bool:
    """Whether the calling thread runs inside torch.autograd.backward or grad (a CPU graph's
    backward runs on the thread that called it): a module's forward there is a recomputation
    by a node's backward (a reentrant checkpoint's). A walk of the Python frames: an attempt
    to queue an autograd callback would tell too, but costs a millisecond where it fails."""
    codes = (torch.autograd.backward.__code__, torch.autograd.grad.__code__)
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def _forget_owner(key: int, ref: Any) -> None:
    """A parameter is gone: its entry goes (unless its id is another parameter's now)."""
    entry = _OWNERS.get(key)
    if entry is not None and entry[0] is ref:
        del _OWNERS[key]


# The autograd nodes between a parameter and what autocast saves of it: the cast and views.
_CAST_OR_VIEW = frozenset({"ToCopyBackward0", "TBackward0", "TransposeBackward0",
                           "ViewBackward0", "PermuteBackward0", "ExpandBackward0",
                           "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1"})
_OPTIMIZERS = {"sgd": _hps.Optimizer.SGD, "adamw": _hps.Optimizer.ADAMW}
_DTYPES = {torch.float32: _hps.DType.FLOAT32, torch.float16: _hps.DType.FLOAT16,
           torch.bfloat16: _hps.DType.BFLOAT16}


def _invalid(message: str) -> "_hps.Error":
    return _hps.InvalidArgumentError(_hps.Status.INVALID_ARGUMENT, message)


def _store_listen_host(addr: str) -> str:
    """Where rank 0 listens for hpshard's store at MASTER_ADDR ``addr``, as the library
    listens for tcp://addr:P: 127.0.0.1 for localhost (and *.localhost), a numeric address
    on that address, any other name on every interface."""
    import ipaddress

    host = addr.strip("[]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    lower = host.lower()
    return "127.0.0.1" if lower == "localhost" or lower.endswith(".localhost") else ""


def _comm_timeout_ms(timeout_ms: Optional[int]) -> int:
    """The communicator's timeout world_from_env creates it with: ``timeout_ms``, else the
    library's default (HPS_COMM_TIMEOUT_MS, else 300000 ms), a malformed variable refused as
    the library refuses it."""
    if timeout_ms is not None:
        return int(timeout_ms)
    return int(_hps._c.comm_options_init(_hps._c.comm_options_struct_size()).timeout_ms)


def _torch_store_failed(what: str, e: BaseException, timeout_ms: int) -> "_hps.Error":
    """hpshard's error for a failing call on torch's store (which raises a bare RuntimeError
    or OSError): TIMEOUT for its timeouts, UNAVAILABLE otherwise, naming ``what``."""
    text = str(e)
    if isinstance(e, TimeoutError) or "timeout" in text.lower() or "timed out" in text.lower():
        return _hps._from_status(_hps.Status.TIMEOUT,
                                 f"world_from_env: {what} within {timeout_ms} ms "
                                 f"(torch's store: {text})")
    return _hps._from_status(_hps.Status.UNAVAILABLE,
                             f"world_from_env: {what}: torch's store: {text}")


def _store_beside_torchrun_agent(timeout_ms: Optional[int]) -> None:
    """Under torchrun, MASTER_ADDR:MASTER_PORT is torch's: its agent's store
    (TORCHELASTIC_USE_AGENT_STORE=True), or, without the agent's store (``--standalone``,
    ``--rdzv_backend=c10d``: TORCHELASTIC_RUN_ID set) and wherever RANK and MASTER_PORT are
    set otherwise (a job script setting env://'s variables itself), the port rank 0's
    ``torch.distributed.init_process_group`` (env://) binds, before or after this. Rank 0
    then serves hpshard's store on a port of its own (a listening socket it hands to the
    store, so no other process can take the port in between; on MASTER_ADDR as the library
    binds it: 127.0.0.1 for localhost, a numeric address on that address, another name on
    every interface) and every rank learns the address through torch's store: the agent's;
    torch.distributed's default store when it is initialized; else a TCPStore of the
    exchange's own on MASTER_PORT (rank 0 serving it, as env:// does), which rank 0 closes
    once every other rank has said it has the address, so that torch's own can bind there
    later. The waits there take the communicator's timeout (``timeout_ms``, else
    HPS_COMM_TIMEOUT_MS) and end in hpshard's TIMEOUT naming what was waited for.

    Torch's store has no authentication: a token set in HPS_STORE_TOKEN (every rank's own,
    as torchrun passes the environment on) never goes there; without one, rank 0 makes one
    for the job and shares it there, which any process that reaches MASTER_PORT can read.
    HPS_STORE, HPS_STORE_TOKEN (and, on rank 0, HPS_STORE_FD) are set for
    hpshard.rendezvous_from_env. Nothing happens when HPS_STORE is set already (also when
    empty: the library refuses that, naming it)."""
    env = os.environ
    if "HPS_STORE" in env:
        return
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    torch_style = "RANK" in env and "MASTER_PORT" in env  # env:// init's variables
    if not agent_store and "TORCHELASTIC_RUN_ID" not in env and not torch_style:
        return  # Open MPI or Slurm with HPS_STORE or MASTER_*: the library's store
    if env.get("HPS_STORE_TOKEN") == "":
        raise _invalid("world_from_env: environment variable HPS_STORE_TOKEN is set but empty "
                       "(set a token, or unset it to have the job make one)")
    import datetime

    import torch.distributed as dist

    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise _invalid(f"world_from_env: torchrun's variables {missing} are not set")
    # The library checks the variables (RANK within WORLD_SIZE, MASTER_PORT a port, ...) and
    # then refuses the agent's store; any other refusal names a variable that is wrong.
    try:
        _hps.rendezvous_from_env()
    except _hps.InvalidArgumentError as e:
        if "TORCHELASTIC_USE_AGENT_STORE" not in str(e):
            raise
    rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
    addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    timeout = _comm_timeout_ms(timeout_ms)
    wait = datetime.timedelta(milliseconds=timeout)
    key = "hpshard/store/{}/{}".format(env.get("TORCHELASTIC_RUN_ID", ""),
                                       env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    where = f"{addr}:{port}"
    own = None  # the exchange's own TCPStore, closed before this returns
    initialized = dist.is_available() and dist.is_initialized()
    if agent_store:
        what = f"torchrun's agent store at {where}"
    elif initialized:
        what = "torch.distributed's default store"
    else:
        what = f"the torch TCPStore rank 0 serves on MASTER_ADDR:MASTER_PORT ({where})"
    try:
        if agent_store:
            store = dist.TCPStore(addr, port, size, False, timeout=wait)
        elif initialized:
            store = dist.distributed_c10d._get_default_store()
        else:
            store = own = dist.TCPStore(addr, port, size, rank == 0, timeout=wait,
                                        wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        if rank == 0 and not agent_store:
            raise _torch_store_failed(
                f"rank 0 cannot serve a torch TCPStore on MASTER_ADDR:MASTER_PORT ({where}) "
                f"to tell the ranks hpshard's store", e, timeout) from e
        raise _torch_store_failed(f"rank {rank} cannot reach {what}", e, timeout) from e
    listener = None
    try:
        if rank == 0:
            listener, published = _publish_store(env, store, key, addr, what, timeout)
            if own is not None and size > 1:
                try:
                    own.wait([key + "/all"], wait)
                except (RuntimeError, OSError) as e:
                    raise _torch_store_failed(
                        f"rank 0 waited for the other {size - 1} ranks to read key '{key}' "
                        f"from {what}", e, timeout) from e
            if "token" in published:
                env["HPS_STORE_TOKEN"] = published["token"]
            env["HPS_STORE_FD"] = str(listener.detach())  # the store takes the socket over
            env["HPS_STORE"] = published["url"]
        else:
            try:
                store.wait([key], wait)
                published = json.loads(store.get(key).decode())
                if own is not None and int(own.add(key + "/have", 1)) == size - 1:
                    own.set(key + "/all", "1")
            except (RuntimeError, OSError) as e:
                raise _torch_store_failed(
                    f"rank {rank} waited for rank 0 to publish hpshard's store (key '{key}') "
                    f"in {what}", e, timeout) from e
            mine = env.get("HPS_STORE_TOKEN")
            if published.get("token_set") and not mine:
                raise _invalid(f"world_from_env: rank 0 has HPS_STORE_TOKEN set, rank {rank} "
                               f"has not (set the same token on every rank)")
            if "token" in published and mine:
                raise _invalid(f"world_from_env: rank {rank} has HPS_STORE_TOKEN set, rank 0 "
                               f"has not (set the same token on every rank, or on none)")
            env["HPS_STORE"] = published["url"]
            if "token" in published:
                env["HPS_STORE_TOKEN"] = published["token"]
    finally:
        if listener is not None:
            listener.close()  # detached (a no-op) unless this failed
        # Closes MASTER_PORT on rank 0 (torch's own store binds it later). Every other rank
        # said it had the address first, and none returns from world_from_env before rank 0
        # has joined hpshard's store, after this.
        del store, own


def _publish_store(env: Any, store: Any, key: str, addr: str, what: str,
                   timeout: int) -> Tuple[Any, Dict[str, Any]]:
    """Rank 0: bind hpshard's store's listening socket and publish its address (and a token
    of the job's own, unless HPS_STORE_TOKEN is set) under ``key`` in torch's ``store``.
    Returns the socket and what was published."""
    import secrets
    import socket

    family = socket.AF_INET6 if ":" in addr.strip("[]") else socket.AF_INET
    bind = _store_listen_host(addr)
    try:
        listener = socket.create_server((bind, 0), family=family)
    except OSError as e:
        raise _hps._from_status(
            _hps.Status.UNAVAILABLE,
            f"world_from_env: rank 0 cannot listen for hpshard's store on "
            f"{bind or 'every interface'} (MASTER_ADDR={addr}): {e}") from e
    try:
        listener.set_inheritable(False)
        host = addr.strip("[]")
        url = "tcp://{}:{}".format("[" + host + "]" if ":" in host else host,
                                   listener.getsockname()[1])
        # A token of the job's own (unless one is set): connections that are not this
        # job's ranks are closed, as under hpshard-run.
        published: Dict[str, Any] = {"url": url}
        if "HPS_STORE_TOKEN" in env:
            published["token_set"] = True  # each rank has it: not a byte of it published
        else:
            published["token"] = secrets.token_hex(32)
        try:
            store.set(key, json.dumps(published))
        except (RuntimeError, OSError) as e:
            raise _torch_store_failed(f"rank 0 cannot publish hpshard's store in {what}", e,
                                      timeout) from e
    except BaseException:
        listener.close()
        raise
    return listener, published


def world_from_env(timeout_ms: Optional[int] = None) -> "_hps.Communicator":
    """The world communicator of a process started by hpshard-run, torchrun, Open MPI or
    Slurm (hpshard.rendezvous_from_env, then the store and a communicator over it). Under
    torchrun, or with torch's env:// variables set by hand (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT), where MASTER_PORT is torch's (its agent's store, or the one rank 0's
    ``torch.distributed.init_process_group`` binds, before or after this), rank 0 serves
    hpshard's store on a port of its own and the ranks find it through torch's store.
    ``timeout_ms`` (else HPS_COMM_TIMEOUT_MS, else 300000) bounds that exchange and the
    communicator's operations. The communicator owns its store: closing the communicator
    closes the store too, so a program may call this again after closing the first world
    (its store was left open, and the second open refused)."""
    _store_beside_torchrun_agent(timeout_ms)
    info = _hps.rendezvous_from_env()
    store = _hps.Store.open(info.store_url, info.rank)
    world = _hps.Communicator.create(store, info.rank, info.world_size, timeout_ms=timeout_ms,
                                     name="world")
    world._owned_store = store  # closed right after the communicator
    return world


def _tensor_over(view: Any, dtype: torch.dtype) -> torch.Tensor:
    """A torch tensor over the memory of an engine view, without a copy."""
    import numpy as np
    # Never an inference tensor (one made under torch.inference_mode()), which training
    # could not use later: these tensors are kept and reused.
    with torch.inference_mode(False):
        if not _is_numpy(view) and hasattr(view, "__dlpack__"):
            t = torch.utils.dlpack.from_dlpack(view)
        elif dtype == torch.bfloat16:  # NumPy has no bfloat16: the view holds the bit patterns
            t = torch.from_numpy(view.view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(view)
    if t.dtype != dtype:
        raise TypeError(f"hpshard.torch: an engine view of {t.dtype} for a {dtype} parameter")
    return t


def _is_numpy(view: Any) -> bool:
    import numpy as np
    return isinstance(view, np.ndarray)


def _storage_key(t: torch.Tensor) -> int:
    """The address the storage of ``t`` starts at (its base tensor's data pointer)."""
    return t.data_ptr() - t.storage_offset() * t.element_size()


def _husks(params: List[torch.Tensor]) -> Tuple[List[torch.Tensor],
                                                 List[Tuple[torch.Tensor, List[int]]]]:
    """What released parameters are: each a tensor of its shape over one element (every
    stride 0), a negative zero, so it holds no memory and reads as zeros (a storage of no
    bytes under the shape let torch read and write past it). The elements of one dtype are
    one tensor's, returned with the indices of their parameters: most in-place writes to a
    husk are refused by torch; one that is not (fill_, zero_, through p.data too) changes
    its element, which then is not -0.0 (see _check_lost_writes)."""
    by_dtype: Dict[torch.dtype, List[int]] = {}
    for i, p in enumerate(params):
        by_dtype.setdefault(p.dtype, []).append(i)
    husks: List[Any] = [None] * len(params)
    values = []
    with torch.inference_mode(False):
        for dtype, indices in by_dtype.items():
            elements = torch.full((len(indices),), -0.0, dtype=dtype)
            values.append((elements, indices))
            for j, i in enumerate(indices):
                husks[i] = elements[j].expand(params[i].shape)
    return husks, values


def _dataclass_fields(value: Any, seen: set) -> List[Tuple[str, Any]]:
    """A dataclass instance's fields that are set, as (name, value), once per object in a
    walk (``seen``: a dataclass that refers to itself); [] for anything else."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type) or id(value) in seen:
        return []
    seen.add(id(value))
    fields = []
    for f in dataclasses.fields(value):
        v = getattr(value, f.name, _MISSING)  # an init=False field may be unset
        if v is not _MISSING:
            fields.append((f.name, v))
    return fields


def _tensors_in(value: Any, seen: Optional[set] = None) -> Iterable[torch.Tensor]:
    if seen is None:
        seen = set()
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v, seen)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v, seen)
    else:
        for _, v in _dataclass_fields(value, seen):
            yield from _tensors_in(v, seen)


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor],
                 seen: Optional[set] = None) -> Any:
    """``value`` with every tensor t in it (through lists, tuples, named tuples, dicts and
    dataclasses) replaced by fn(t); containers are rebuilt only where something changed (a
    dataclass is copied and its fields set, frozen ones too)."""
    if seen is None:
        seen = set()
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        items = [_map_tensors(v, fn, seen) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*items)
        return type(value)(items)
    if isinstance(value, dict):
        items = {k: _map_tensors(v, fn, seen) for k, v in value.items()}
        if all(items[k] is v for k, v in value.items()):
            return value
        out = copy.copy(value)
        for k, v in items.items():
            out[k] = v
        return out
    fields = _dataclass_fields(value, seen)
    if fields:
        changed = {}
        for name, old in fields:
            new = _map_tensors(old, fn, seen)
            if new is not old:
                changed[name] = new
        if not changed:
            return value
        out = copy.copy(value)
        for k, v in changed.items():
            object.__setattr__(out, k, v)
        return out
    return value


def _decimal(text: str) -> bool:
    """Whether ``text`` is what the library reads as a number: ASCII digits only
    (``str.isdigit`` also takes other scripts' digits and superscripts)."""
    return text.isascii() and text.isdigit()


def _umask() -> int:
    """This process's umask, read without changing it (os.umask would, for every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _trace_pid() -> int:
    """The process id the library's timeline gives this process (core/trace): its rank as
    the environment named it when the library loaded, else its pid."""
    for name in ("HPS_RANK", "RANK"):
        text = _hps._TRACE_ENV[name]
        if _decimal(text) and int(text) < (1 << 30):
            return int(text)
    return os.getpid()


class _Timeline:
    """Spans of the framework's own work (forward and backward per unit, step), written as
    a Chrome trace beside the library's when HPS_TRACE is set. One per process."""

    _instance: Optional["_Timeline"] = None
    _lock = threading.Lock()

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.events: List[dict] = []
        self.files = 0
        self.dropped = 0
        text = _hps._TRACE_ENV["HPS_TRACE_MAX_EVENTS"]
        self.max_events = int(text) if _decimal(text) and int(text) > 0 else 2_000_000
        self.lock = threading.Lock()
        atexit.register(self.write)
        # A forked child starts with no spans (the parent's are the parent's to write), as the
        # library's timeline does.
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self.lock = threading.Lock()  # the parent's may have been held by another thread
        self.events = []
        self.dropped = 0
        self.files = 0

    @classmethod
    def get(cls) -> Optional["_Timeline"]:
        directory = _hps._TRACE_ENV["HPS_TRACE"]
        if not directory:
            return None
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls(directory)
            return cls._instance

    def span(self, name: str, begin_ns: int, end_ns: int, rank: int) -> None:
        """A span of this thread; ``rank``: the sharding rank it worked for (threads of one
        process may be different ranks)."""
        with self.lock:
            if len(self.events) >= self.max_events:
                self.dropped += 1
                return
            self.events.append({"ph": "X", "cat": "compute", "name": name,
                                "pid": _trace_pid(), "tid": threading.get_native_id(),
                                "ts": begin_ns / 1000.0, "dur": (end_ns - begin_ns) / 1000.0,
                                "args": {"rank": rank}})

    def write(self) -> Optional[str]:
        """Writes the spans recorded since the last file; the file's path, or None when
        there were none or it could not be written (a warning says why, as the library's
        timeline does: training goes on, and an error under way stays the one raised)."""
        with self.lock:
            events, self.events = self.events, []
            dropped, self.dropped = self.dropped, 0
            if not events:
                return None
            index, self.files = self.files, self.files + 1
        try:
            return self._write(events, dropped, index)
        except OSError as e:
            warnings.warn(f"hpshard.torch: cannot write the timeline into {self.directory!r} "
                          f"(HPS_TRACE): {e}; {len(events)} spans are lost", RuntimeWarning)
            return None

    def _write(self, events: List[dict], dropped: int, index: int) -> str:
        os.makedirs(self.directory, exist_ok=True)
        pid = _trace_pid()
        rank = f"rank{pid}-" if pid != os.getpid() else ""
        stem = os.path.join(self.directory, f"torch-{rank}pid{os.getpid()}-{index}")
        # A temporary name of this process's own, then the first free name of STEM.json,
        # STEM.1.json, ...: a process of another pid namespace (containers sharing the
        # directory) or of another host can have this pid.
        fd, temporary = tempfile.mkstemp(dir=self.directory,
                                         prefix=os.path.basename(stem) + ".json.tmp-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                           "otherData": {"producer": "hpshard.torch",
                                         "clock": "CLOCK_MONOTONIC",
                                         "dropped_events": dropped}}, f)
            os.chmod(temporary, 0o666 & ~_umask())
            for n in range(10_000):
                path = stem + (f".{n}" if n else "") + ".json"
                try:
                    os.link(temporary, path)
                except FileExistsError:
                    continue
                except OSError:  # no hard links here: a rename where nothing is
                    if os.path.lexists(path):
                        continue
                    os.replace(temporary, path)
                    return path
                return path
            raise OSError(f"every name from {stem}.json on is taken")
        finally:
            if os.path.lexists(temporary):
                os.unlink(temporary)


class _Unit:
    """One unit: its parameter indices and what this rank knows of it in this step."""

    def __init__(self, uid: int, name: str) -> None:
        self.uid = uid
        self.name = name
        self.params: List[int] = []
        self.trainable: List[int] = []
        self.has_frozen = False
        self.gathered = False       # between gather and release (stage 3: parameters present)
        self.refilled = False       # stage 3: gathered across a step, which gathers it again
        self.forward_depth = 0      # nested/repeated forward calls under way
        self.recomputing = False    # its forward runs again in backward (checkpointing)
        self.in_backward = False    # gathered for backward
        self.bound = False          # stage 3: its gradient views taken for this backward
        self.pending = 0            # trainable parameters not checked in this backward
        self.checked: set = set()   # those checked in
        self.versions: Dict[int, int] = {}  # stage 3: parameters' version counters at gather
        self.span_begin = 0


class ShardedModule(torch.nn.Module):
    """Wraps ``module`` for stage 2 or stage 3 sharded training over ``sharding`` (a
    Communicator, or a HybridGroup whose sharding and dp communicators are used) and an
    optional ``dp`` communicator above it. See the module's documentation.

    ``units``: submodules (or their dotted names) gathered and released together; the
    remaining parameters are one more unit. ``optimizer``: "adamw" or "sgd" with ``lr``,
    ``betas``, ``eps``, ``weight_decay``, ``momentum``, ``nesterov`` meaning what torch.optim's
    do; the defaults are the signature's (``weight_decay`` 0.0 for AdamW too, where
    torch.optim.AdamW's is 1e-2: pass it to decay as that does).
    ``no_weight_decay``: the parameters weight decay skips (biases and norms, as a torch
    parameter group with ``weight_decay=0``): parameters, their names (a tied parameter
    goes by any of its names), or a predicate ``(name, parameter) -> bool`` (asked once per
    name).
    ``clip_max_norm`` > 0: global-norm clipping, the coefficient max_norm / (max(norm,
    max_norm) + 1e-6) (clip_grad_norm_'s, except that below max_norm it is
    1 - 1e-6 / max_norm where torch's is 1). ``dynamic_loss_scaling``:
    multiply the loss by :attr:`loss_scale` (or use :meth:`scale_loss`). Creating it is
    collective over the groups; rank 0's initial parameter values are everyone's.

    In a topology with tensor (``mp``) or pipeline (``pp``) parallelism, the module is this
    rank's part of the model: pass this rank's ``mp`` and ``pp`` communicators (taken from
    a HybridGroup given as ``sharding`` when their degree is above 1) and, in
    ``distributed``, the parameters split across mp (same forms as ``no_weight_decay``).
    The clip norm then sums those over mp and every counted gradient over pp, and a
    non-finite gradient on any rank skips the step everywhere
    (:meth:`hpshard.Engine.set_model_parallel_groups`). ``shared_not_first``: the
    parameters that are a later pipeline stage's copy of a weight an earlier stage holds
    too (a tied embedding; their gradients made equal by the caller): scaled by the clip
    but not counted in its norm, so the weight counts once. ``no_clip``: the parameters
    whose gradients the clip neither counts nor scales (Paddle's ``need_clip`` False).
    Both take the same forms as ``no_weight_decay``."""

    def __init__(self, module: torch.nn.Module, sharding: Any,
                 dp: Optional["_hps.Communicator"] = None, *, stage: int = 3,
                 units: Union[Sequence[Union[torch.nn.Module, str]], torch.nn.Module] = (),
                 optimizer: str = "adamw", lr: float = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, momentum: float = 0.0, nesterov: bool = False,
                 clip_max_norm: float = 0.0, deterministic_clip: bool = False,
                 accumulation_steps: int = 1, prefetch_window: int = 3,
                 dynamic_loss_scaling: bool = False, initial_loss_scale: float = 65536.0,
                 alignment_bytes: Optional[int] = None,
                 no_weight_decay: Union[Iterable[Union[str, torch.nn.Parameter]],
                                        Callable[[str, torch.nn.Parameter], bool]] = (),
                 mp: Optional["_hps.Communicator"] = None,
                 pp: Optional["_hps.Communicator"] = None,
                 distributed: Union[Iterable[Union[str, torch.nn.Parameter]],
                                    Callable[[str, torch.nn.Parameter], bool]] = (),
                 shared_not_first: Union[Iterable[Union[str, torch.nn.Parameter]],
                                         Callable[[str, torch.nn.Parameter], bool]] = (),
                 no_clip: Union[Iterable[Union[str, torch.nn.Parameter]],
                                Callable[[str, torch.nn.Parameter], bool]] = ()
                 ) -> None:
        super().__init__()
        self._owned: List[Any] = []  # communicators taken from a hybrid group, closed with us
        if isinstance(sharding, _hps.HybridGroup):
            group = sharding
            sharding = group.comm(_hps.Group.SHARDING)
            self._owned.append(sharding)
            if dp is None and group.topology.degree(_hps.Group.DP) > 1:
                dp = group.comm(_hps.Group.DP)
                self._owned.append(dp)
            if mp is None and group.topology.degree(_hps.Group.MP) > 1:
                mp = group.comm(_hps.Group.MP)
                self._owned.append(mp)
            if pp is None and group.topology.degree(_hps.Group.PP) > 1:
                pp = group.comm(_hps.Group.PP)
                self._owned.append(pp)
        if not isinstance(sharding, _hps.Communicator):
            raise TypeError("ShardedModule: sharding must be an hpshard.Communicator or "
                            f"HybridGroup, not {type(sharding).__name__}")
        if stage not in (2, 3):
            raise ValueError(f"ShardedModule: stage must be 2 or 3, not {stage}")
        if optimizer not in _OPTIMIZERS:
            raise ValueError(f"ShardedModule: optimizer must be one of {sorted(_OPTIMIZERS)}")
        if accumulation_steps < 1:
            raise ValueError("ShardedModule: accumulation_steps must be at least 1")
        self.module = module
        self.stage = stage
        self.sharding = sharding
        self.dp = dp
        self.mp = mp
        self.pp = pp
        self.accumulation_steps = int(accumulation_steps)
        self._engine_kwargs = dict(
            stage=stage, optimizer=_OPTIMIZERS[optimizer], learning_rate=lr, momentum=momentum,
            weight_decay=weight_decay, nesterov=nesterov, betas=betas, eps=eps,
            clip_max_norm=clip_max_norm, deterministic_clip=deterministic_clip,
            accumulation_steps=accumulation_steps, prefetch_window=prefetch_window,
            dynamic_loss_scaling=dynamic_loss_scaling, initial_loss_scale=initial_loss_scale,
            alignment_bytes=alignment_bytes)
        self._timeline = _Timeline.get()
        self._rank = sharding.rank
        self._hooks: list = []
        self._plan_units(units)
        self._decayed = [not x for x in self._select(no_weight_decay, "no_weight_decay")]
        self._distributed = self._select(distributed, "distributed")
        self._shared_not_first = self._select(shared_not_first, "shared_not_first")
        self._clipped = [not x for x in self._select(no_clip, "no_clip")]
        self._engine: Optional[_hps.Engine] = None
        self._view_cache: Dict[int, Tuple[int, torch.Tensor]] = {}
        self._gathered_keys: Dict[int, int] = {}  # storage address -> parameter index
        self._micro_batches = 0  # backward passes since the last step
        self._steps = 0  # step() calls: a graph saved before one is refused after it
        # The forwards' outputs carrying a graph, by id: (the tensor, weakly; its step).
        self._outputs: Dict[int, Tuple[Any, int]] = {}
        # The forward under way: the step of the oldest graph its inputs carry (None: none).
        self._graph_step: Optional[int] = None
        # A backward failed after some of its gradients checked in: until load_state_dict().
        self._half_done = False
        self._in_no_sync = False
        self._backward_active = False
        # Inside full_parameters(): each parameter's full copy, and what it held before.
        self._full: Optional[List[torch.Tensor]] = None
        self._claim_parameters()
        try:
            # The gradient accumulators are taken while the parameters still hold their
            # values.
            self._install_grad_hooks()
            self._start_engine(initial=[p.data for p in self._params])
            self._install_module_hooks()
        except BaseException:
            self._release_parameters()
            raise
        self._hidden_modules: Optional[Dict[str, Any]] = None
        self.register_load_state_dict_post_hook(ShardedModule._unhide_modules)

    def _claim_parameters(self) -> None:
        """Each parameter belongs to one open ShardedModule: a second one over the same
        module (or a module holding it) is refused before anything changes; its engine would
        replace the first's parameter data, which the first then took for the user's
        ``p.data = ...``."""
        for name, p in zip(self._names, self._params):
            other = _owner_of(p)
            if other is not None and other is not self and other._engine is not None:
                raise ValueError(
                    f"ShardedModule: parameter '{name}' belongs to another open ShardedModule "
                    f"(the module is wrapped already; one dropped without close() stays open, "
                    f"its hooks keep it): close that one first, "
                    f"hpshard.torch.wrapper_of(module).close(), or wrap the module once")
        me = weakref.ref(self)
        for p in self._params:
            _OWNERS[id(p)] = (weakref.ref(p, functools.partial(_forget_owner, id(p))), me)

    def _release_parameters(self) -> None:
        for p in self._params:
            if _owner_of(p) is self:
                del _OWNERS[id(p)]

    # ---- set-up --------------------------------------------------------------------
    def _plan_units(self, units: Any) -> None:
        if isinstance(units, torch.nn.Module):
            units = list(units.children()) if isinstance(
                units, (torch.nn.ModuleList, torch.nn.Sequential)) else [units]
        names = {id(m): n for n, m in self.module.named_modules()}
        unit_modules: List[Tuple[str, torch.nn.Module]] = []
        for u in units:
            if isinstance(u, str):
                try:
                    m = self.module.get_submodule(u)
                except AttributeError:
                    raise ValueError(f"ShardedModule: the module has no submodule {u!r}") \
                        from None
            else:
                m = u
            if id(m) not in names or m is self.module:
                raise ValueError("ShardedModule: units must be submodules of the module "
                                 "(not the module itself)")
            unit_modules.append((names[id(m)], m))
        # Which units each module belongs to: a unit's subtree is that unit. A unit inside
        # another is refused; a submodule reached through two units (one LayerNorm in two
        # blocks), or through a unit and also outside every unit (a block's layer the parent
        # holds as an attribute of its own), belongs to each of them, so its parameters are
        # shared across units (the rest, below).
        unit_of_module = {id(m): k for k, (_, m) in enumerate(unit_modules, start=1)}
        if len(unit_of_module) != len(unit_modules):
            raise ValueError("ShardedModule: a unit is listed twice")
        for k, (uname, m) in enumerate(unit_modules, start=1):
            for sub in m.modules():
                if sub is not m and id(sub) in unit_of_module:
                    inner = unit_modules[unit_of_module[id(sub)] - 1][0]
                    raise ValueError(f"ShardedModule: unit {inner!r} overlaps another unit: "
                                     f"it is inside unit {uname!r}")
        module_units: Dict[int, set] = collections.defaultdict(set)
        walked = set()  # (module, unit): each reached once per unit context
        pending = [(self.module, 0)]
        while pending:
            m, k = pending.pop()
            for child in m._modules.values():
                if child is None:
                    continue
                ck = unit_of_module.get(id(child), k)
                if (id(child), ck) not in walked:
                    walked.add((id(child), ck))
                    module_units[id(child)].add(ck)
                    pending.append((child, ck))
        self._units: List[_Unit] = [_Unit(0, "rest")] + [
            _Unit(k, uname) for k, (uname, _) in enumerate(unit_modules, start=1)]
        self._unit_modules = [m for _, m in unit_modules]
        # Every parameter once (tied ones by their first name), with every unit using it.
        params: List[torch.nn.Parameter] = []
        pnames: List[str] = []
        index_of: Dict[int, int] = {}
        users: Dict[int, set] = collections.defaultdict(set)
        for mname, m in self.module.named_modules(remove_duplicate=False):
            for pname, p in m._parameters.items():
                if p is None:
                    continue
                if id(p) not in index_of:
                    index_of[id(p)] = len(params)
                    params.append(p)
                    pnames.append(f"{mname}.{pname}" if mname else pname)
                users[id(p)].update(module_units.get(id(m), (0,)))
        self._params = params
        self._names = pnames
        self._index_of = index_of
        self._param_unit: List[int] = []
        for i, p in enumerate(params):
            if p.dtype not in _DTYPES:
                raise TypeError(f"ShardedModule: parameter {pnames[i]!r} is {p.dtype}; the "
                                "engine trains float32, float16 and bfloat16 parameters")
            if p.device.type != "cpu":
                raise ValueError(f"ShardedModule: parameter {pnames[i]!r} is on {p.device}; "
                                 "hpshard.torch trains CPU modules")
            u = users[id(p)]
            uid = next(iter(u)) if len(u) == 1 else 0  # shared across units: the rest
            self._param_unit.append(uid)
            unit = self._units[uid]
            unit.params.append(i)
            if p.requires_grad:
                unit.trainable.append(i)
            else:
                unit.has_frozen = True
        self._units = [u for u in self._units if u.params or u.uid == 0]
        self._unit_by_id = {u.uid: u for u in self._units}
        # What the engine was built from, checked at every forward: a parameter or submodule
        # replaced, added or removed, or a parameter frozen or unfrozen, after wrapping would
        # otherwise train silently wrong (the engine updates the parameters it registered).
        self._structure = [(m, tuple(m._parameters.items()), tuple(m._modules.items()))
                           for m in self.module.modules()]
        self._requires_grad = [p.requires_grad for p in params]

    def _select(self, exclude: Any, what: str) -> List[bool]:
        """Per parameter: whether ``exclude`` (parameters, their names or a predicate
        ``(name, parameter) -> bool``; the keyword ``what``) picks it."""
        named = [(f"{mname}.{pname}" if mname else pname, p)
                 for mname, m in self.module.named_modules(remove_duplicate=False)
                 for pname, p in m._parameters.items() if p is not None]
        if callable(exclude):
            skipped = {id(p) for n, p in named if exclude(n, p)}
        else:
            if isinstance(exclude, (str, torch.Tensor)):
                exclude = [exclude]
            by_name = {n: p for n, p in named}
            skipped = set()
            for e in exclude:
                if isinstance(e, str):
                    if e not in by_name:
                        raise ValueError(f"ShardedModule: {what} names {e!r}, which is "
                                         "not a parameter of the module")
                    skipped.add(id(by_name[e]))
                elif isinstance(e, torch.Tensor):
                    if id(e) not in self._index_of:
                        raise ValueError(f"ShardedModule: {what} holds a tensor that "
                                         "is not a parameter of the module")
                    skipped.add(id(e))
                else:
                    raise TypeError(f"ShardedModule: {what} takes parameters, their "
                                    f"names or a predicate, not {type(e).__name__}")
        return [id(p) in skipped for p in self._params]

    def _unit(self, uid: int) -> _Unit:
        return self._unit_by_id[uid]

    def _check_structure(self) -> None:
        """Raises naming what changed in the wrapped module since it was wrapped."""
        changed = None
        for m, params, children in self._structure:
            now_params, now_children = m._parameters, m._modules
            if (len(now_params) != len(params) or len(now_children) != len(children)
                    or any(now_params.get(n, _MISSING) is not p for n, p in params)
                    or any(now_children.get(n, _MISSING) is not c for n, c in children)):
                changed = m
                break
        if changed is None:
            for i, p in enumerate(self._params):
                if p.requires_grad != self._requires_grad[i]:
                    raise RuntimeError(
                        f"hpshard.torch: parameter {self._names[i]!r} was "
                        f"{'unfrozen' if p.requires_grad else 'frozen'} after ShardedModule "
                        "wrapped the module; the engine trains the parameters as they were "
                        "registered: set requires_grad before wrapping")
                if self._data_replaced(i, p):
                    raise RuntimeError(
                        f"hpshard.torch: the data of parameter {self._names[i]!r} was "
                        "replaced (p.data = ..., p.set_(), share_memory()) after ShardedModule "
                        "wrapped the module; its values live in the engine's memory, so the "
                        "model would compute with the new tensor while the engine trains the "
                        "old one: "
                        + ("write float32 values in place (p.copy_(...) under torch.no_grad(), "
                           "after synchronize()) or use load_state_dict()" if self.stage == 2 else
                           "use load_state_dict() (with stage 3 a parameter holds its values "
                           "only inside its unit's forward and backward)"))
            return
        where = next((n for n, m in self.module.named_modules() if m is changed), None)
        where = repr(where) if where else "the wrapped module itself"
        raise RuntimeError(
            f"hpshard.torch: the parameters or submodules of {where} were replaced, added or "
            "removed after ShardedModule wrapped the module; the engine trains the parameters "
            "it registered, so training would silently leave the new ones untrained: change "
            "the module before wrapping it")

    def _data_replaced(self, i: int, p: torch.Tensor) -> bool:
        """Whether parameter i's data is elsewhere than the adapter put it: the engine's
        memory (stage 2: its address since the engine started; stage 3: a gathered unit's
        view) or its released husk (stage 3). Costs no call into the engine."""
        if p.numel() == 0:
            return False  # no memory to compare
        if self._full is not None:
            return p.data_ptr() != self._full[i].data_ptr()
        if self.stage == 2:
            return p.data_ptr() != self._resident[i]
        if self._unit(self._param_unit[i]).gathered:
            return self._gathered_keys.get(_storage_key(p.data)) != i
        return p.data_ptr() != self._husks[i].data_ptr()

    def _start_engine(self, initial: List[torch.Tensor]) -> None:
        """A fresh engine holding ``initial`` (rank 0's values win), the parameters pointed
        at it."""
        kwargs = {k: v for k, v in self._engine_kwargs.items() if v is not None}
        engine = _hps.Engine.create(self.sharding, self.dp, **kwargs)
        if engine.device[0] != _hps.DeviceType.CPU:
            engine.close()
            raise ValueError("hpshard.torch: the engine is on "
                             f"{engine.device}; the adapter trains CPU modules")
        try:
            if self.mp is not None or self.pp is not None:
                engine.set_model_parallel_groups(self.mp, self.pp)
        except BaseException:
            engine.close()
            raise
        for i, p in enumerate(self._params):
            engine.add_param(self._names[i], tuple(p.shape), _DTYPES[p.dtype],
                             frozen=not p.requires_grad, unit=self._param_unit[i],
                             weight_decay=self._decayed[i], distributed=self._distributed[i],
                             shared_not_first=self._shared_not_first[i],
                             clip=self._clipped[i])
        engine.seal()
        with torch.no_grad():
            for i, p in enumerate(self._params):
                _tensor_over(engine.param(i), p.dtype).copy_(initial[i])
        engine.broadcast_parameters()
        old, self._engine = self._engine, engine
        if old is not None:
            old.close()
        self._view_cache.clear()
        self._gathered_keys.clear()
        self._husks, self._husk_values = _husks(self._params)
        # A husk's element address names its parameter (the husks of a dtype share storage).
        self._husk_keys = {h.data_ptr(): i for i, h in enumerate(self._husks)}
        self._husk_storages = {_storage_key(v) for v, _ in self._husk_values}
        # Stage 2: each parameter's version counter when the adapter last saw it, and the
        # parameters whose step all-gather may still be writing them (since step(), until
        # their unit's next gather or synchronize()).
        self._versions = [p._version for p in self._params]
        self._gathering: set = set()
        # A checkpoint's save reads the state on a stream of its own: from save() until
        # synchronize(), or a unit's gather after the next step (whose update waits for the
        # save's copies), a parameter written in place may be read half written.
        self._snapshot_pending = False
        self._stepped_since_save = False
        engine._checkpoint_hooks.append(weakref.WeakMethod(self._before_checkpoint))
        self._grad_views: List[Optional[torch.Tensor]] = [None] * len(self._params)
        # What p.grad was bound to for the backward under way (the engine's memory).
        self._bound_grads: Dict[int, torch.Tensor] = {}
        self._resident: List[int] = [0] * len(self._params)  # stage 2: where each lives
        for u in self._units:
            u.gathered = u.in_backward = u.bound = False
            u.forward_depth = u.pending = 0
        if self.stage == 2:  # resident for good: the parameters are the engine's
            for i, p in enumerate(self._params):
                p.data = self._param_view(i)
                self._resident[i] = p.data_ptr()
                if p.requires_grad:
                    self._grad_views[i] = _tensor_over(engine.grad(i), p.dtype)
        else:
            for i, p in enumerate(self._params):
                p.data = self._husks[i]
                p.grad = None

    def _install_grad_hooks(self) -> None:
        # Autograd's gradient accumulator of each trainable parameter: its post-hook runs
        # once the parameter's gradient for this backward is complete. The accumulators are
        # kept referenced (autograd holds them weakly), so every graph uses these; they
        # survive the parameters' data being swapped (same dtype and device).
        self._accumulators = []
        with torch.enable_grad():
            for i, p in enumerate(self._params):
                if not p.requires_grad:
                    continue
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                self._hooks.append(acc.register_hook(self._make_grad_hook(i)))
                self._accumulators.append(acc)
                # Runs as the gradient arrives, before autograd adds it into p.grad (and only
                # in a backward that accumulates: torch.autograd.grad does not run it).
                self._hooks.append(p.register_hook(self._make_arrival_hook(i)))

    def _install_module_hooks(self) -> None:
        """A unit's module gathers before any of its forward pre-hooks and releases after all
        of its forward hooks (weight_norm's and spectral_norm's pre-hooks, a user's hooks
        registered before or after wrapping read its parameters): the gather is moved to the
        front of its pre-hooks, and each forward moves the release to the end."""
        for u, m in zip(self._units_named(), self._unit_modules_of()):
            post = m.register_forward_hook(self._make_post_forward(u, m))
            pre = m.register_forward_pre_hook(self._make_pre_forward(u, m, post.id))
            m._forward_pre_hooks.move_to_end(pre.id, last=False)
            self._hooks += [pre, post]
        root = self.module.register_forward_pre_hook(self._make_root_pre_forward())
        self.module._forward_pre_hooks.move_to_end(root.id, last=False)
        self._hooks.append(root)

    def _units_named(self) -> List[_Unit]:
        return [u for u in self._units if u.uid != 0]

    def _unit_modules_of(self) -> List[torch.nn.Module]:
        return [self._unit_modules[u.uid - 1] for u in self._units_named()]

    # ---- views ----------------------------------------------------------------------
    def _param_view(self, i: int) -> torch.Tensor:
        """Parameter i's tensor over the engine's memory. A tensor over a NumPy view only
        points at the memory, so it is kept and reused while the address holds; one over a
        DLPack view holds the engine's memory alive, so it is never kept past a release."""
        address = self._engine.param_address(i)
        cached = self._view_cache.get(i)
        if cached is not None and cached[0] == address:
            return cached[1]
        view = self._engine.param(i)
        t = _tensor_over(view, self._params[i].dtype)
        if _is_numpy(view):
            self._view_cache[i] = (address, t)
        return t

    # ---- gather / release (stage 3 moves memory; stage 2 only waits, and its release
    # tells the engine the unit is out of use, so a checkpoint's load may come) ----------
    def _gather(self, u: _Unit) -> None:
        if self.stage == 3 and u.gathered and not u.refilled:
            return
        # (A unit gathered across a step is gathered again by it, in place: its next use
        # waits for that.)
        self._engine.wait_parameters(u.uid)
        u.refilled = False
        self._gathering.difference_update(u.params)
        if self._stepped_since_save and any(self._params[i].requires_grad for i in u.params):
            self._snapshot_pending = self._stepped_since_save = False
        if self.stage == 3:
            for i in u.params:
                view = self._param_view(i)
                p = self._params[i]
                p.data = view
                self._gathered_keys[_storage_key(view)] = i
                u.versions[i] = p._version
        u.gathered = True

    def _wait_for_step_gathers(self) -> None:
        """Stage 2, the first forward after a step: waits for every unit's all-gather of the
        update, as the forward may read a unit's parameter before that unit's own forward
        (a parent calling its submodule, F.linear(h, unit.weight)) and would read it while
        the all-gather still wrote it. A dependency wait, no host sync."""
        for u in self._units:
            if not any(i in self._gathering for i in u.params):
                continue
            self._engine.wait_parameters(u.uid)
            if not u.gathered:
                self._engine.release_parameters(u.uid)
        self._gathering.clear()

    def _release(self, u: _Unit) -> None:
        if not u.gathered:
            return
        self._engine.release_parameters(u.uid)
        if self.stage == 3:
            for i in u.params:
                p = self._params[i]
                self._gathered_keys.pop(_storage_key(p.data), None)
                p.data = self._husks[i]
        u.gathered = False

    def _bind_gradients(self, u: _Unit) -> None:
        """Autograd adds into the engine's gradient memory from here on (this backward)."""
        for i in u.trainable:
            p = self._params[i]
            if self.stage == 3:  # a zeroed full gradient buffer, taken for this backward
                p.grad = _tensor_over(self._engine.grad(i), p.dtype)
            elif p.grad is None or p.grad.data_ptr() != self._grad_views[i].data_ptr():
                p.grad = self._grad_views[i]
            self._bound_grads[i] = p.grad

    # ---- forward --------------------------------------------------------------------
    def _begin_forward(self, u: _Unit) -> None:
        if self._full is not None:  # full_parameters(): nothing to gather
            return
        if not self._backward_active and u.forward_depth == 0 and _inside_backward():
            # A reentrant checkpoint recomputing the unit before any hook of this backward
            # ran (every parameter inside such checkpoints): the backward starts here, so
            # its end is the outer backward's, not that of the checkpoint's own backward.
            try:
                self._start_backward()
            except BaseException:
                self._abandon_backward()
                raise
        if self._backward_active:
            # A unit's forward run again by backward (torch.utils.checkpoint recomputing
            # it): its backward follows, so it is gathered for that now. Stage 3 runs it
            # over copies of the parameters: what the checkpoint keeps of them may be read
            # again by a later backward of a kept graph, after the unit's memory went back.
            if u.forward_depth == 0:
                if not u.in_backward:
                    u.span_begin = time.monotonic_ns()
                    self._enter_backward(u)
                if self.stage == 3 and u.gathered:
                    for i in u.params:
                        p = self._params[i]
                        p.data = p.data.clone()
                u.recomputing = True
            u.forward_depth += 1
            return
        if u.forward_depth == 0:
            u.span_begin = time.monotonic_ns()
            if u.params:
                self._gather(u)
                # Not after the step's last backward (a metric's forward): p.grad stays None
                # while the engine reduces the gradients.
                if (self.stage == 2 and torch.is_grad_enabled() and
                        self._micro_batches < self.accumulation_steps):
                    self._bind_gradients(u)
                if self.stage == 3 and (torch.is_autocast_cpu_enabled() or
                                        torch.is_autocast_enabled()):
                    # autocast keeps the casts of parameters for its whole region: one taken
                    # of the released zeros (a use outside the unit) must not stand for them.
                    torch.clear_autocast_cache()
        u.forward_depth += 1

    def _end_forward(self, u: _Unit, output: Any) -> Any:
        """After the unit's forward: its outputs, copied where they are its gathered memory
        and it is released now."""
        if self._full is not None:
            return output
        u.forward_depth -= 1
        if u.forward_depth:
            return output
        if u.recomputing:  # its backward follows: the parameters go back to the engine's
            u.recomputing = False
            if self.stage == 3 and u.gathered:
                for i in u.params:
                    self._params[i].data = self._param_view(i)
            return output

        def backward_roots(value: Any) -> List[torch.Tensor]:
            if not (torch.is_grad_enabled() and u.params):
                return []
            return [t for t in _tensors_in(value) if t.requires_grad and t.grad_fn is not None]

        # The rest's backward begins as soon as backward does: it stays gathered from its
        # forward on rather than being released and gathered again at once (which would
        # also put it between the last block's forward and backward in the recorded order,
        # so that block would be released and gathered again).
        release = bool(u.params) and not (u.uid == 0 and backward_roots(output))
        if release and self.stage == 3:
            self._check_unwritten(u)
            output = self._copy_out(u, output)
        # Its backward starts when the gradient of one of its outputs arrives.
        for t in backward_roots(output):
            t.register_hook(self._make_pre_backward(
                u, self._steps if self._graph_step is None else self._graph_step))
        if release:
            self._release(u)
        if self._timeline:
            self._timeline.span(f"forward {u.name}", u.span_begin, time.monotonic_ns(),
                                self._rank)
        return output

    def _check_writes(self) -> None:
        """Stage 2: a parameter written in place since the adapter last looked (its version
        counter moved) is kept when the write holds; refused, naming it, when it cannot: a
        trainable float16 / bfloat16 one (the next step rounds the fp32 master over it), or
        one whose step (its update, its all-gather) may still have been writing it. Stage 3:
        see _check_lost_writes."""
        if self.stage == 3:
            self._check_lost_writes()
            return
        for i, p in enumerate(self._params):
            if p._version == self._versions[i]:
                continue
            self._versions[i] = p._version  # each write is reported once
            if p.requires_grad and p.dtype != torch.float32:
                raise RuntimeError(
                    f"hpshard.torch: parameter {self._names[i]!r} ({p.dtype}) was written in "
                    "place; its values are the engine's float32 master rounded at each step, "
                    "so the write would be lost: set it with load_state_dict()")
            if i in self._gathering:
                raise RuntimeError(
                    f"hpshard.torch: parameter {self._names[i]!r} was written in place after "
                    "step() while the step (its update, its all-gather) may still have been "
                    "writing it, so its values are undefined: call synchronize() before "
                    "writing parameters (or write them after the next forward has begun)")
            if self._snapshot_pending:
                raise RuntimeError(
                    f"hpshard.torch: parameter {self._names[i]!r} was written in place after "
                    "a checkpoint's save() while the save may still have been copying it, so "
                    "the checkpoint may hold either value, or part of each: call "
                    "synchronize() after save() before writing parameters")

    def _check_lost_writes(self) -> None:
        """Stage 3: a parameter written in place outside a forward that checks it (an init_
        or a p.fill_() after wrapping, between steps; a forward's renormalisation in the
        rest) wrote its released husk or a gathered copy that the next gather replaces,
        never the engine's shards: the write is lost, so it is refused, naming it (once).
        A write through p.data moves no version counter: a husk's element that is not -0.0
        any more shows it. Written husk elements are -0.0 again after."""
        written = None
        for i, p in enumerate(self._params):
            if p._version != self._versions[i]:
                self._versions[i] = p._version
                if p.numel() and written is None:  # (an empty one wrote nothing)
                    written = i
        for elements, indices in self._husk_values:
            changed = ~torch.signbit(elements) | (elements != 0)
            if bool(changed.any()):
                if written is None:
                    written = indices[int(changed.nonzero()[0])]
                elements.fill_(-0.0)
        if written is not None:
            raise RuntimeError(
                f"hpshard.torch: parameter {self._names[written]!r} was written in place "
                "after ShardedModule wrapped the module (an init_ or fill_, through p.data "
                "too, or a forward's own renormalisation as nn.Embedding(max_norm=...) does); "
                "with stage 3 the engine keeps only this rank's shard of it and the parameter "
                "holds its values only inside its unit's forward and backward, so the write "
                "was lost: initialise parameters before wrapping, or set them with "
                "load_state_dict()")

    def _before_checkpoint(self, operation: str) -> None:
        """Called by hpshard.Checkpoint on this module's engine before an operation starts.
        A load or import inside full_parameters() is refused: the block's copies would keep
        the values from before it. Before a save, the writes made before it are checked (and
        saved); those after it, until the save's copies are known done, are refused (see
        _check_writes). Stage 3: a write, lost, is refused."""
        if operation != "save":
            self._refuse_inside_full(f"hpshard.Checkpoint.{operation}()")
            return
        if self.stage != 2:
            self._check_writes()
            return
        self._check_writes()
        self._snapshot_pending = True
        self._stepped_since_save = False

    def _check_unwritten(self, u: _Unit) -> None:
        """Stage 3: a parameter written in place by the unit's forward would lose the write
        at the release (the engine keeps its shards); refused, naming it."""
        for i in u.params:
            if self._params[i]._version != u.versions.get(i):
                self._versions[i] = self._params[i]._version  # reported here, once
                raise RuntimeError(
                    f"hpshard.torch: parameter {self._names[i]!r} was written in place during "
                    f"the forward of unit {u.name!r} (nn.Embedding(max_norm=...) renormalises "
                    "its weight's rows so); with stage 3 the write would be lost when the unit "
                    "is released: only the optimizer's step changes parameters")

    def _copy_out(self, u: _Unit, output: Any) -> Any:
        """Outputs over the unit's gathered memory (a parameter, or a view of one, returned
        as is) are copied: the release hands that memory back to the engine."""
        mine = {_storage_key(self._params[i].data) for i in u.params
                if self._params[i].data.numel()}

        def own(t: torch.Tensor) -> torch.Tensor:
            if t.numel() and t.device.type == "cpu" and _storage_key(t) in mine:
                return t.clone()
            return t
        return _map_tensors(output, own)

    def _make_pre_forward(self, u: _Unit, m: torch.nn.Module, release: int):
        def hook(module, args):
            if module is not m:
                return  # a copy of the module (copy.deepcopy keeps its hooks): not this unit
            self._check_called_through_wrapper("a unit's module (" + type(m).__name__ + ")")
            if release in m._forward_hooks:  # last: torch takes the hooks after the forward
                m._forward_hooks.move_to_end(release)
            self._begin_forward(u)
        return hook

    def _make_root_pre_forward(self):
        root = self.module

        def hook(module, args):
            if module is root:  # not a copy of it (copy.deepcopy keeps its hooks)
                self._check_called_through_wrapper("the wrapped module")
        return hook

    def _check_called_through_wrapper(self, what: str) -> None:
        """Refuses a forward of the wrapped module, or of a unit, that is not under the
        ShardedModule's (``net(x)`` where ``model(x)`` belongs): only its forward waits for the
        step's all-gathers (stage 2) and gathers the parameters outside every unit (stage 3),
        so such a forward would read stale values or zeros, and train on them unseen."""
        if self._units[0].forward_depth:
            return
        if self._full is not None:
            if torch.is_grad_enabled():
                raise RuntimeError(
                    f"hpshard.torch: {what} was called with gradients enabled inside "
                    "full_parameters(); it evaluates only: run it under torch.no_grad() or "
                    "torch.inference_mode(), and train outside it through the ShardedModule")
            return
        if self._backward_active or _inside_backward():
            return  # a recomputation (torch.utils.checkpoint), gathered by _begin_forward
        raise RuntimeError(
            f"hpshard.torch: {what} was called directly, not through the ShardedModule: "
            "call the ShardedModule (model(x), not model.module(x) or the module it wrapped), "
            "whose forward gathers the parameters and waits for the last step's updates; "
            "inside full_parameters() the wrapped module may be called under "
            "torch.no_grad()")

    def _make_post_forward(self, u: _Unit, m: torch.nn.Module):
        def hook(module, args, output):
            if module is not m:
                return None  # a copy of the module: not this unit
            return self._end_forward(u, output)
        return hook

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._open("forward")
        self._check_structure()
        self._check_writes()
        if self._full is not None:
            if torch.is_grad_enabled():
                raise RuntimeError(
                    "hpshard.torch: a forward with gradients enabled inside "
                    "full_parameters(); it evaluates only: run it under torch.no_grad() or "
                    "torch.inference_mode(), and train outside it")
            return self.module(*args, **kwargs)
        if self._backward_active:
            try:  # refused outside a backward
                torch.autograd.Variable._execution_engine.queue_callback(lambda: None)
            except RuntimeError:
                # The last backward raised in the model's own code: autograd dropped its end
                # callback. It ends here, as one the adapter's hooks refused does.
                self._abandon_backward()
            else:
                raise RuntimeError("hpshard.torch: a forward while a backward is under way")
        self._graph_step = self._earlier_graph(args, kwargs) if torch.is_grad_enabled() else None
        if self.stage == 2 and self._gathering:
            self._wait_for_step_gathers()
        root = self._units[0]
        self._begin_forward(root)
        try:
            if self.stage == 3:
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                    output = self.module(*args, **kwargs)
            else:
                output = self.module(*args, **kwargs)
        except BaseException:
            root.forward_depth = 0
            for u in self._units:
                u.forward_depth = 0
                self._release(u)
            raise
        try:
            output = self._end_forward(root, output)
        except BaseException:
            root.forward_depth = 0
            self._release(root)
            raise
        finally:
            self._graph_step = None
        self._note_outputs(output)
        return output

    def _note_outputs(self, output: Any) -> None:
        for t in _tensors_in(output):
            if t.grad_fn is None:
                continue
            key = id(t)
            self._outputs[key] = (weakref.ref(t, lambda _, key=key: self._outputs.pop(key, None)),
                                  self._steps)

    def _earlier_graph(self, args: Any, kwargs: Any) -> Optional[int]:
        """The step of the oldest forward before the last step() whose output, still carrying
        its graph, is an input here (a recurrent state not detached), or None. A backward of
        this forward would reach that graph part way, after this step's first gradients had
        checked in, and fail there: its hooks refuse it where it starts instead (a forward
        whose graph is never backwarded, a metric, goes on)."""
        oldest = None
        for t in _tensors_in((args, kwargs)):
            seen = self._outputs.get(id(t))
            if seen is None or seen[0]() is not t or seen[1] == self._steps:
                continue
            if t.grad_fn is None:  # detach_()ed since
                continue
            oldest = seen[1] if oldest is None else min(oldest, seen[1])
        return oldest

    # ---- saved tensors (stage 3) -----------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        if t.device.type == "cpu" and t.numel():
            key = _storage_key(t)
            i = self._gathered_keys.get(key)
            if i is not None:
                return (_ParamRef, i, tuple(t.shape), tuple(t.stride()), t.storage_offset(),
                        self._steps)
            i = self._husk_keys.get(t.data_ptr()) if key in self._husk_storages else None
            if i is None:
                i = self._released_cast(t)
            if i is not None:  # an operation took a released parameter's zeros as its value
                u = self._unit(self._param_unit[i])
                raise RuntimeError(
                    f"hpshard.torch: parameter {self._names[i]!r} of unit {u.name!r} was used "
                    "outside that unit's forward, where stage 3 holds it released (it reads as "
                    "zeros): use it inside the unit's forward, or leave its module out of "
                    "units (it is then gathered with the rest for the whole forward)")
        return t

    def _released_cast(self, t: torch.Tensor) -> Optional[int]:
        """The index of the released parameter ``t`` is a cast of, or a view of such a cast
        (autocast's copy of it in another dtype, which an operation saves in the parameter's
        place, transposed for a linear layer), else None."""
        fn, cast = t.grad_fn, False
        for _ in range(4):
            if fn is None:
                return None
            name = type(fn).__name__
            if name == "AccumulateGrad":
                p = getattr(fn, "variable", None)
                if not cast or not isinstance(p, torch.Tensor):
                    return None
                return self._husk_keys.get(p.data.data_ptr())
            if name not in _CAST_OR_VIEW or len(fn.next_functions) != 1:
                return None
            cast = cast or name == "ToCopyBackward0"
            fn = fn.next_functions[0][0]
        return None

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, tuple) and packed and packed[0] is _ParamRef:
            _, i, shape, stride, offset, steps = packed
            if steps != self._steps and self._params[i].requires_grad:
                # As torch's version check refuses a graph kept across optimizer.step().
                raise RuntimeError(
                    f"hpshard.torch: one of the variables needed for gradient computation has "
                    f"been modified by an inplace operation: parameter {self._names[i]!r} was "
                    f"updated by step() after the forward that saved it (torch raises the "
                    f"same for a graph kept across optimizer.step())")
            u = self._unit(self._param_unit[i])
            if not u.gathered:
                # Backward needs it before a gradient reached any output of the unit (a
                # side loss the unit kept, computed after its output): its backward starts.
                try:
                    self._start_backward()
                    u.span_begin = time.monotonic_ns()
                    self._enter_backward(u)
                except BaseException:
                    self._abandon_backward()
                    raise
            return self._params[i].data.as_strided(shape, stride, offset)
        return packed

    # ---- backward -------------------------------------------------------------------
    def _start_backward(self) -> None:
        if self._backward_active:
            return
        self._refuse_when_half_done("a backward")
        if self._full is not None:
            raise RuntimeError(
                "hpshard.torch: a backward inside full_parameters(); the engine reduces "
                "gradients over every rank, outside it: run the backward after the block")
        self._backward_active = True
        for u in self._units:
            u.pending = len(u.trainable)
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _make_pre_backward(self, u: _Unit, steps: int):
        def hook(grad):
            try:
                if steps != self._steps:
                    self._refuse_a_kept_graph()
                self._start_backward()
                if not u.in_backward:
                    u.span_begin = time.monotonic_ns()
                    self._enter_backward(u)
            except BaseException:
                self._abandon_backward()
                raise
            return grad
        return hook

    def _refuse_a_kept_graph(self) -> None:
        """A graph kept from before a step: refused where its backward starts (the version
        counters torch checks would stop it only part way, some gradients checked in)."""
        message = ("hpshard.torch: one of the variables needed for gradient computation has "
                   "been modified by an inplace operation: this backward needs a graph made "
                   "before the last step() (kept with retain_graph=True, or carried in by an "
                   "input not detached, a recurrent state), and step() updated the parameters "
                   "it saved (torch raises the same for a graph kept across optimizer.step()); "
                   "detach() what carries a graph from one step into the next")
        if self._backward_active and any(u.checked for u in self._units):
            # Reached part way through a backward of this step's graph, which carried the
            # old one in through a tensor computed from an earlier output.
            message += ("; this backward reached it after some of this step's gradients had "
                        "checked in, so the step is half done: start afresh with "
                        "load_state_dict(state_dict())")
        raise RuntimeError(message)

    def _refuse_when_half_done(self, what: str) -> None:
        if self._half_done:
            raise _hps.FailedPreconditionError(
                _hps.Status.FAILED_PRECONDITION,
                f"hpshard.torch: {what} after a backward that failed once some of its "
                f"gradients had checked in: the step is half done; start afresh with "
                f"load_state_dict(state_dict())")

    def _abandon_backward(self) -> None:
        """A hook raised, or the model's own code in backward did (found at the next forward):
        autograd stops the backward and never runs its end callback, so what that callback
        resets is reset here. Training goes on when the backward was
        refused before any gradient checked in (a second backward before step()); one that
        failed after some checked in leaves the engine's micro-batch half done: the next
        backward and step() are refused until load_state_dict() starts afresh."""
        if not self._backward_active:  # refused before it started: nothing to undo
            return
        if any(u.checked for u in self._units):
            self._half_done = True
        for u in self._units:
            u.forward_depth = 0  # a recomputation that raised
            u.recomputing = False
            try:
                if u.in_backward:
                    self._leave_backward(u)
                elif u.gathered and not u.bound:
                    self._release(u)
            except Exception:  # noqa: BLE001 — the error that ended the backward is the one
                pass
            u.checked.clear()
            u.pending = 0
        self._backward_active = False

    def _enter_backward(self, u: _Unit) -> None:
        if u.params:
            self._gather(u)
            if self.stage == 2:
                self._bind_gradients(u)
        u.in_backward = True

    def _bind_unit(self, u: _Unit) -> None:
        """Stage 3 takes a unit's gradient views once a gradient of it arrives, not when its
        backward begins: a backward that accumulates nothing (torch.autograd.grad) takes
        none, so the unit can be released after it."""
        if self.stage == 3 and not u.bound:
            self._bind_gradients(u)
            u.bound = True

    def _make_arrival_hook(self, i: int):
        def hook(grad):
            try:
                if self._micro_batches >= self.accumulation_steps:
                    # Before the first gradient is added: the engine would refuse its
                    # check-in, and at stage 2 the addition would land in gradients its
                    # reductions may be reading.
                    raise _hps.FailedPreconditionError(
                        _hps.Status.FAILED_PRECONDITION,
                        f"hpshard.torch: a backward after this step's last one "
                        f"(accumulation_steps={self.accumulation_steps}): call step() first")
                self._start_backward()
                u = self._unit(self._param_unit[i])
                if not u.in_backward:
                    u.span_begin = time.monotonic_ns()
                    self._enter_backward(u)
                self._bind_unit(u)
            except BaseException:
                self._abandon_backward()
                raise
        return hook

    def _make_grad_hook(self, i: int):
        def hook(grad_inputs, grad_outputs):
            if not grad_outputs or grad_outputs[0] is None:
                # Nothing was added (a Function's backward returned None for the parameter,
                # having added its gradient by a backward of its own): no completion.
                return
            try:
                self._start_backward()
                self._check_in(i)
            except BaseException:
                self._abandon_backward()
                raise
        return hook

    def _check_in(self, i: int) -> None:
        u = self._unit(self._param_unit[i])
        p = self._params[i]
        if i in u.checked:
            raise RuntimeError(
                f"hpshard.torch: the gradient of parameter {self._names[i]!r} was completed "
                "twice in one backward (torch.utils.checkpoint with use_reentrant=True runs a "
                "backward of its own per call, and this parameter is used by two calls); the "
                "engine reduces a gradient once it is complete: use use_reentrant=False")
        if not u.in_backward:
            # A gradient reached a unit through no output of it (a parameter used outside
            # its unit's forward): autograd made a tensor of its own; add it in.
            grad = p.grad
            p.grad = None
            self._enter_backward(u)
            self._bind_unit(u)
            if grad is not None:
                with torch.no_grad():
                    p.grad.add_(grad)
        else:
            bound = self._bound_grads.get(i)
            if bound is not None and p.grad is not None and p.grad is not bound:
                # backward(create_graph=True): autograd set p.grad to a new tensor (the bound
                # gradient plus this one, with a graph) rather than adding in place.
                with torch.no_grad():
                    bound.copy_(p.grad)
                p.grad = bound
        self._engine.grad_ready(i)
        u.checked.add(i)
        u.pending -= 1
        if u.pending == 0 and not u.has_frozen:
            self._leave_backward(u)

    def _leave_backward(self, u: _Unit) -> None:
        for i in u.trainable:
            self._bound_grads.pop(i, None)  # (stage 3: the engine's memory, not kept)
        if self.stage == 3:
            for i in u.trainable:
                self._params[i].grad = None  # the engine reduces and frees that memory
            u.bound = False
        self._release(u)
        u.in_backward = False
        if self._timeline:
            self._timeline.span(f"backward {u.name}", u.span_begin, time.monotonic_ns(),
                                self._rank)

    def _finish_backward(self) -> None:
        """End of a backward: unused parameters check in a zero gradient, units still held
        are released, the micro-batch is counted. A backward that completed no trainable
        parameter's gradient (torch.autograd.grad, backward(inputs=...)) is no micro-batch:
        nothing checks in and nothing is counted."""
        if any(u.trainable for u in self._units) and not any(u.checked for u in self._units):
            try:
                for u in self._units:
                    u.pending = 0
                    if u.in_backward:
                        self._leave_backward(u)
            finally:
                self._backward_active = False
            return
        try:
            for u in self._units:
                if u.pending:
                    if not u.in_backward:
                        self._enter_backward(u)
                    self._bind_unit(u)
                    for i in u.trainable:
                        if i not in u.checked:
                            self._engine.grad_ready(i)  # its gradient stayed zero
                    u.pending = 0
                if u.in_backward:
                    self._leave_backward(u)
        finally:
            self._backward_active = False
            for u in self._units:
                u.checked.clear()
        self._micro_batches += 1
        last = not self._in_no_sync
        # The engine took the micro-batch either way: the count stays its count, so that
        # the step's remaining backward passes and step() go on from there.
        n, k = self._micro_batches, self.accumulation_steps
        if last and n != k:
            raise RuntimeError(
                f"hpshard.torch: accumulation_steps={k}, but backward number {n} of this step "
                f"ran outside no_sync() (only the last one does): its gradients were taken as "
                f"micro-batch {n} of {k}; run the first {k - 1} inside no_sync()")
        if not last and n >= k:
            raise RuntimeError(
                f"hpshard.torch: accumulation_steps={k}: backward number {n} of this step ran "
                f"inside no_sync(); the last one must run outside it (its gradients were "
                f"taken: step() comes next)")
        if last and self.stage == 2:
            # The engine reduces the gradients from here on: p.grad would be this rank's
            # part, read or scaled (clip_grad_norm_) while the reductions read it.
            for p in self._params:
                p.grad = None

    # ---- the step -------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside are micro-batches before the step's last one (see the
        module documentation); the engine adds their gradients into its shards."""
        self._open("no_sync()")
        if self.accumulation_steps == 1:
            raise RuntimeError("hpshard.torch: no_sync() needs accumulation_steps > 1 at "
                               "construction (the engine reduces per micro-batch)")
        previous, self._in_no_sync = self._in_no_sync, True
        try:
            yield
        finally:
            self._in_no_sync = previous

    def set_learning_rate(self, lr: float) -> None:
        """The learning rate of the next steps (a schedule's value, set before each step on
        every rank, e.g. ``model.set_learning_rate(scheduler_fn(step))``); no host sync. It
        holds until the next call, across :meth:`load_state_dict` too."""
        self._open("set_learning_rate()").set_learning_rate(lr)
        self._engine_kwargs["learning_rate"] = float(lr)

    def step(self) -> None:
        """The optimizer step on this rank's shards and the parameters' all-gathers
        (enqueued; no host sync)."""
        begin = time.monotonic_ns()
        self._open("step()")
        self._refuse_inside_full("step()")
        self._refuse_when_half_done("step()")
        if self._micro_batches != self.accumulation_steps:
            raise RuntimeError(f"hpshard.torch: step() after {self._micro_batches} backward "
                               f"passes; accumulation_steps is {self.accumulation_steps}")
        self._check_writes()
        self._engine.step()
        self._steps += 1
        for u in self._units:
            u.refilled = self.stage == 3 and u.gathered
        if self.stage == 2:
            # The update writes the parameters in place, as torch.optim's does: their
            # version counters move (no element written here), so a backward of a graph
            # kept from before the step raises as torch's does.
            with torch.no_grad():
                for i, p in enumerate(self._params):
                    if p.requires_grad and p.numel():
                        p.as_strided((0,), (1,)).zero_()
                        self._versions[i] = p._version
        if self.stage == 2:
            self._gathering = {i for i, p in enumerate(self._params) if p.requires_grad}
            self._stepped_since_save = self._snapshot_pending
        self._micro_batches = 0
        if self.stage == 2:  # gradients are zero again after the step's reductions
            for i, p in enumerate(self._params):
                if p.requires_grad:
                    p.grad = None
        if self._timeline:
            self._timeline.span("step", begin, time.monotonic_ns(), self._rank)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine zeroes gradients itself at each step; kept for optimizer-style loops."""

    @property
    def loss_scale(self) -> float:
        """The dynamic loss scale (1.0 without): multiply the loss by it before backward.
        Read after this step's forward has begun (its first gather)."""
        return self._open("loss_scale").loss_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale if self._engine_kwargs["dynamic_loss_scaling"] else loss

    @property
    def skipped_steps(self) -> int:
        return self._open("skipped_steps").skipped_steps

    @property
    def grad_norm(self) -> float:
        """With ``clip_max_norm`` > 0: the global norm of the last step's gradients, as
        torch's ``clip_grad_norm_`` returns it (the whole model's over every rank; Inf or NaN
        for a step with a non-finite gradient). Read it as :attr:`loss_scale`: after the next
        forward has begun, or after :meth:`synchronize`."""
        return self._open("grad_norm").grad_norm

    @property
    def engine(self) -> "_hps.Engine":
        """The hpshard.Engine underneath (None after :meth:`close`)."""
        return self._engine

    @property
    def resident_bytes(self) -> int:
        """Bytes the engine holds on this rank (parameters, gradients, optimizer state and,
        at stage 3, the full buffers of gathered units and those pooled for the next gather)."""
        return self._open("resident_bytes").resident_bytes

    def synchronize(self) -> None:
        """Wait for everything in flight (a host sync: not for the training step); after
        it, stage 2 parameters hold the last step's values (and float32 ones may be written
        in place). A parameter written in place that could not hold the write (see the
        module's notes) raises here, naming it, once everything has completed."""
        self._open("synchronize()").synchronize()
        try:
            self._check_writes()
        finally:
            self._gathering = set()
            self._snapshot_pending = self._stepped_since_save = False

    @contextlib.contextmanager
    def full_parameters(self):
        """Inside the block the module's parameters hold their full values on this rank (as
        FSDP's ``summon_full_params``, every rank holds the whole model meanwhile), so any
        subset of ranks may evaluate: rank 0 alone, say, running the wrapped module or its
        units under ``torch.no_grad()`` with no collective (a stage 3 forward outside it
        gathers units with the other ranks). Entering is collective over the sharding group
        (each parameter's :meth:`hpshard.Engine.gather_parameter`: fp16 / bf16 parameters
        are their fp32 masters rounded); leaving is not. The values are copies: a
        parameter written inside the block raises as the block ends, naming it, and
        the engine's values stay (use :meth:`load_state_dict`). Inside, a forward with
        gradients enabled, a backward, :meth:`step` and :meth:`load_state_dict` raise."""
        self._open("full_parameters()")
        self._refuse_inside_full("full_parameters()")
        if self._backward_active:
            raise RuntimeError("hpshard.torch: full_parameters() while a backward is under way")
        if any(u.forward_depth for u in self._units):
            raise RuntimeError("hpshard.torch: full_parameters() inside a forward")
        self._check_structure()
        self._check_writes()
        values = self._save_parameters()
        previous = [p.data for p in self._params]
        for p, v in zip(self._params, values):
            p.data = v
        versions = [p._version for p in self._params]
        prints = [_fingerprint(v) for v in values]  # a write through p.data moves no version
        self._full = values
        failed = True
        try:
            yield
            failed = False
        finally:
            self._full = None
            written = [self._names[i] for i, p in enumerate(self._params)
                       if p._version != versions[i] or _fingerprint(values[i]) != prints[i]]
            if self._engine is not None:  # close() inside gave them their values already
                for p, old in zip(self._params, previous):
                    p.data = old
                # What was written inside went to the copies (refused below), not the engine.
                self._versions = [p._version for p in self._params]
        if written and not failed:
            raise RuntimeError(
                f"hpshard.torch: parameter {written[0]!r} was written inside "
                "full_parameters(); the block holds copies of the engine's values, so the "
                "write was dropped: set parameters with load_state_dict()")

    def _open(self, what: str) -> "_hps.Engine":
        """The engine, or ValueError after :meth:`close` (its parameters are plain tensors
        of the wrapped module now)."""
        if self._engine is None:
            raise ValueError(f"hpshard.torch: {what} on a closed ShardedModule: close() "
                             "ended its engine; the wrapped module (.module) holds the "
                             "parameters' last values")
        return self._engine

    def _refuse_inside_full(self, what: str) -> None:
        if self._full is not None:
            raise RuntimeError(f"hpshard.torch: {what} inside full_parameters(); it "
                               "evaluates only: call it after the block")

    # ---- state ----------------------------------------------------------------------
    def _save_parameters(self) -> List[torch.Tensor]:
        """Every parameter's full value (collective)."""
        out = []
        for i, p in enumerate(self._params):
            full = torch.from_numpy(self._engine.gather_parameter(i))
            out.append(full.to(p.dtype))
        return out

    def _load_parameters(self, values: List[torch.Tensor]) -> None:
        """A fresh engine over ``values`` (rank 0's win; collective)."""
        self._start_engine(values)

    def state_dict(self, *args: Any, destination: Optional[Dict[str, Any]] = None,
                   prefix: str = "", keep_vars: bool = False) -> Dict[str, torch.Tensor]:
        """Full parameters and the module's buffers, keyed as ``module.state_dict()`` (tied
        parameters under each of their names) after ``prefix``, into ``destination`` when
        given (as ``nn.Module.state_dict``, so a module holding this one saves it under its
        name). Parameters are copies whatever ``keep_vars`` says. Collective over the
        sharding group."""
        if len(args) > 3:
            raise TypeError("ShardedModule.state_dict() takes at most 3 positional arguments")
        if args:  # the deprecated positional form: destination, prefix, keep_vars
            destination = args[0]
            prefix = args[1] if len(args) > 1 else prefix
        self._open("state_dict()")
        self._check_writes()
        values = self._save_parameters()
        out: Dict[str, Any] = collections.OrderedDict() if destination is None else destination
        for key, v in self.module.state_dict(keep_vars=True).items():
            i = self._index_of.get(id(v))
            out[prefix + key] = values[i] if i is not None else v.detach().clone()
        return out

    def load_state_dict(self, state_dict: Dict[str, torch.Tensor], strict: bool = True) -> Any:
        """Parameters (and buffers) from ``state_dict``, keyed as ``module.state_dict()``;
        the engine restarts from them with a fresh optimizer state. Collective: every rank
        calls it; rank 0's parameter values are everyone's (the other ranks' dicts may lack
        keys, with ``strict=False``; a parameter rank 0's dict lacks keeps its value), and
        each rank's buffers, its own, come from its own dict. A dict refused on
        one rank (strict keys, a shape) is refused on every rank, and nothing is loaded. A
        module holding this one loads it through its own ``load_state_dict`` the same
        way. Between a step's first backward and its ``step()`` it is refused
        (FailedPreconditionError, nothing loaded): the step's gradients would be lost. The
        module's :attr:`engine` is a new one afterwards: the old one is closed, and with it
        every :class:`hpshard.Checkpoint` made over it (make it again over the new one)."""
        missing, unexpected = self._load_entries(state_dict, strict)
        return collections.namedtuple("IncompatibleKeys", "missing_keys unexpected_keys")(
            missing, unexpected)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        """nn.Module.load_state_dict of a module holding this one: the entries under
        ``prefix`` as :meth:`load_state_dict` takes them (every rank must load)."""
        entries = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        # torch goes on into this module's children next (self.module, under prefix +
        # "module.", where no entry is: the keys are the plain module's, loaded here), then
        # runs this module's load post-hooks. The children are hidden until then: they
        # would report every key missing, and a BatchNorm, finding no version for its
        # prefix, would set num_batches_tracked to 0 over the value loaded here.
        try:
            missing, unexpected = self._load_entries(entries, False)
        except RuntimeError as e:  # refused on every rank: torch raises after the hooks
            error_msgs.append(str(e))
            missing, unexpected = [], []
        self._hidden_modules, self._modules = self._modules, collections.OrderedDict()
        missing_keys.extend(prefix + k for k in missing)
        unexpected_keys.extend(prefix + k for k in unexpected)

    @staticmethod
    def _unhide_modules(module: "ShardedModule", incompatible: Any) -> None:
        if module._hidden_modules is not None:
            module._modules, module._hidden_modules = module._hidden_modules, None

    def _load_entries(self, state_dict: Dict[str, torch.Tensor],
                      strict: bool) -> Tuple[List[str], List[str]]:
        self._open("load_state_dict()")
        self._refuse_inside_full("load_state_dict()")
        if self._micro_batches and not self._half_done:
            # The same on every rank: the ranks make the same backward passes.
            raise _hps.FailedPreconditionError(
                _hps.Status.FAILED_PRECONDITION,
                f"ShardedModule.load_state_dict: after {self._micro_batches} backward "
                f"pass(es) of a step and before its step(): the engine it starts anew would "
                f"drop their gradients; call step() first, or load before the step's first "
                f"backward")
        own = self.module.state_dict(keep_vars=True)
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        # Everything is checked before anything changes, and the ranks agree on the outcome
        # before any collective: a rank whose dict fails (or lacks a parameter) would
        # otherwise make other calls than its peers.
        problem = None
        if strict and (missing or unexpected):
            problem = (f"ShardedModule.load_state_dict: missing keys {missing}, "
                       f"unexpected keys {unexpected}")
        for key, v in own.items():
            src = state_dict.get(key)
            if problem is None and src is not None and tuple(src.shape) != tuple(v.shape):
                problem = (f"ShardedModule.load_state_dict: {key!r} has shape "
                           f"{tuple(src.shape)}, the module {tuple(v.shape)}")
        lacks_param = any(self._index_of.get(id(own[k])) is not None for k in missing)
        failed_elsewhere, gather = self._agree_on_load(problem is not None, lacks_param)
        if problem is not None:
            raise RuntimeError(problem)
        if failed_elsewhere:
            raise RuntimeError("ShardedModule.load_state_dict: the state dict of another rank "
                               "was refused (that rank names the cause), so no rank loaded")
        # A parameter some rank's dict lacks keeps the engine's value there (rank 0's values
        # are everyone's): gathered on every rank, the gather being collective.
        values: List[Any] = (self._save_parameters() if gather
                             else [p.detach() for p in self._husks])
        for key, v in own.items():
            if key not in state_dict:
                continue
            src = state_dict[key]
            i = self._index_of.get(id(v))
            if i is None:
                with torch.no_grad():
                    v.copy_(src)
            else:
                values[i] = src.detach().to(self._params[i].dtype)
        self._load_parameters(values)
        self._micro_batches = 0  # a half-done step's, dropped with the old engine
        self._half_done = False
        return missing, unexpected

    def _agree_on_load(self, failed: bool, lacks_param: bool) -> Tuple[bool, bool]:
        """Over the engine's ranks (sharding x dp): whether any rank's dict was refused, and
        whether any lacks a parameter (a host sync: loading is no training step)."""
        flags = torch.tensor([int(failed), int(lacks_param)], dtype=torch.int64)
        for group in (self.sharding, self.dp):
            if group is not None and group.size > 1:
                group.all_reduce(flags, flags, _hps.ReduceOp.MAX).wait()
        return bool(flags[0]), bool(flags[1])

    # ---- end ------------------------------------------------------------------------
    def close(self) -> None:
        """Finish what is in flight and free the engine; the module's parameters become
        plain tensors holding their last values (stage 3: gathered first, collective). A
        stage 2 parameter written in place that could not hold the write raises first, as
        :meth:`synchronize` does, and the module stays open (a second close() closes it). A
        failure of the engine's work (a peer gone during the last step) closes the module
        and raises (stage 3 parameters are not gathered then: they read -0.0); a with-block
        left by another exception raises it too, that exception as its context, unless that
        exception is an hpshard error or KeyboardInterrupt. Neither raises once a call on
        the engine that runs or waits for its work has raised (as
        :meth:`hpshard.Engine.close`),
        nor in a forked child (whose copy is closed without a gather). After it, the
        wrapped module (:attr:`module`) is a plain module, which another ShardedModule may
        wrap (while this one is open that is refused, naming a parameter), and this one's
        calls (forward, step, state_dict, ...) raise ValueError. On the main thread Ctrl-C
        during its gather (a peer alive but not closing: a with-block left by a first
        KeyboardInterrupt gathers too) aborts the engine's communicators and raises
        KeyboardInterrupt."""
        if self._engine is None:
            return
        if self._forked_copy():
            self._close()
            return
        engine = self._engine
        told = engine._told()  # as Engine.close() decides
        try:
            self.synchronize()
        except _hps.Error:
            # The engine's work failed (a peer gone): it stays failed, so the module closes
            # now and the failure raises, unless a call on the engine that runs or waits
            # for its work raised before (the program caught it).
            try:
                self._close()
            except _hps.Error:
                pass  # the same failure, or one it caused
            if told:
                return
            raise
        self._close()

    def _forked_copy(self) -> bool:
        """Whether this is a forked child's copy of the module: its engine is the parent's
        to finish, and a gather would be refused."""
        return self._engine is not None and self._engine._pid != os.getpid()

    def _close(self) -> None:
        if self._engine is None:
            return
        try:
            if not self._forked_copy():  # a forked child keeps what it holds
                values = self._save_parameters()
                for p, v in zip(self._params, values):
                    p.data = v
                    p.grad = None
        finally:
            # Also when the gather failed (a peer gone): the engine, its hooks and the
            # communicators go, and the failure raises after.
            for h in self._hooks:
                h.remove()
            self._hooks = []
            engine, self._engine = self._engine, None
            owned, self._owned = self._owned, []
            try:
                engine.close()
            finally:
                self._release_parameters()
                for comm in owned:
                    comm.close()
                if self._timeline:
                    self._timeline.write()

    def __enter__(self) -> "ShardedModule":
        return self

    def __exit__(self, exc_type: object, exc: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
            return
        engine = self._engine
        told = engine is not None and engine._told()
        try:
            self._close()
        except _hps.Error:
            # An hpshard error or a Ctrl-C under way says enough, and so does an error a
            # call on the engine's work raised before. Any other exception (the program's own,
            # a sys.exit(0)) must not hide a failed step: the failure raises, the program's
            # exception as its context.
            if not (told or isinstance(exc, (_hps.Error, KeyboardInterrupt))):
                raise


class _ParamRef:
    """Marks a saved tensor that is a view of a gathered parameter (see _pack)."""
