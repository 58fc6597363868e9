"""mx behind verl's checkpoint engine: the backend ``"mx"`` of verl 0.9.1's
``CheckpointEngineRegistry``.

verl moves weights from its actor (trainer) workers to its rollout workers through a
``CheckpointEngine`` picked by name; an out-of-tree backend is imported by module name first.
Importing this package registers :class:`MxCheckpointEngine` under ``"mx"``, so a verl run
selects it with configuration only::

    actor_rollout_ref.rollout.checkpoint_engine.backend=mx
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=mx.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.mx.control_url=http://cp:7070
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.mx.model=/models/policy
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.mx.layout=fsdp:8

(``engine_kwargs.mx`` keys: :data:`ENGINE_KWARGS`; strings and numbers, as YAML gives them;
an unknown key or a value out of its domain is refused at construction, the key named.)

The contract (who does what, per ``CheckpointEngineManager.update_weights``):

- **Who pauses.** verl's manager: it aborts in-flight requests, releases the KV cache, and
  resumes both after ``finalize``. mx pauses nothing and calls no engine route.
- **Who installs.** verl's installer: the rollout worker's ``ServerAdapter.update_weights``
  takes the ``(name, tensor)`` pairs :meth:`~MxCheckpointEngine.receive_weights` yields
  (``wire_format = "named_tensors"``), re-buckets them (``update_weights_bucket_megabytes``)
  and feeds them to vLLM's ``load_weights`` in its worker extension.
- **What mx moves.** Actor side (``send_weights``): verl hands a lazy generator that would
  all-gather every FSDP2 parameter (``param.to(device).full_tensor()``) as it is iterated. mx
  iterates it with ``DTensor.full_tensor`` suspended, so each parameter comes out as its
  DTensor, ungathered, and publishes each rank's ``to_local()`` shard (FSDP2's dim-0 rows) in
  place with an :class:`mx.Publisher`. Nothing is gathered. A parameter mx cannot read in
  place is refused with its name: ``.to(device)`` made a copy (e.g. CPU offload to a GPU), a
  plain tensor under an ``fsdp`` layout, another placement or mesh, packed MoE experts that
  verl's ``unfuse_moe_params`` splits into new tensors. Rollout side (``receive_weights``):
  the rank pulls exactly the bytes verl's installer needs (whole checkpoint tensors: vLLM's
  ``load_weights`` cuts its own tensor-parallel slice) over NIXL, straight from the actor
  ranks' memory, and verifies every region's digest, all BEFORE the first tensor is yielded.
- **What mx guarantees.** Verified bytes or nothing: a pull that fails or does not verify
  raises from ``receive_weights`` before anything reaches the installer, so the rollout keeps
  serving the weights it had (verl's ``update_weights`` raises; nothing is half-installed).
  ``receive_weights`` stages when it is called, not when first iterated, so the failure
  comes before verl's ``ServerAdapter`` even opens its transfer to the vLLM workers.
- **Who drives.** The master actor (``is_master``, rank 0) declares each version on mx's
  control plane; every actor rank publishes its shards; each rollout rank stages. Versions:
  ``global_steps`` ``g`` of sync ``s`` (a number the master draws at ``prepare`` and
  ``build_topology`` hands every worker) is the version labelled
  ``<label_prefix>-g<g>-s<s>`` (``-s<s>`` alone when verl passes no step); its id
  (``mx:<hex>``, the Merkle root of its bytes) is :attr:`MxCheckpointEngine.version_id`.
- **What a failure leaves.** ``finalize`` (the manager calls it after every worker's
  update returned) hands the version back: the actor ranks may write their shards again
  (they must not between ``send_weights`` and ``finalize``: verl's manager runs no training
  step there). After a failed sync verl's manager raises before ``finalize``; the next sync's
  ``prepare`` releases what the failed one held, and publishes a new version (a new label).

Importing this package imports verl (``verl.checkpoint_engine``) and torch, not vLLM.
"""

from __future__ import annotations

from ._engine import BACKEND, ENGINE_KWARGS, MxCheckpointEngine, suspended_full_tensor

__all__ = ["BACKEND", "ENGINE_KWARGS", "MxCheckpointEngine", "suspended_full_tensor"]
