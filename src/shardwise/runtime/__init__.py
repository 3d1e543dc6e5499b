"""What the engine keeps and calls around each training step, apart from the model's parts.

- :mod:`shardwise.runtime.counters`: the progress counters as one ``Stateful`` object;
- :mod:`shardwise.runtime.step_hooks`: the seam through which features act around forward
  and after each optimizer step (:class:`~shardwise.runtime.step_hooks.StepHook`);
- :mod:`shardwise.runtime.nonfinite`: the policy for steps with non-finite gradients.

The package sits below the feature packages (``profiling/``, and later ``compression/``...),
which implement the hook protocol; :mod:`shardwise.step_hook_factory`, above them, builds the
configured hooks. Nothing is imported here, so ``import shardwise`` stays free of torch.
"""
