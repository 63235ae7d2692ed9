"""Engine adapters: kvaddr's one-launch step speaking another engine's contract.

Layer: library (engine adapters). Modules here may import only the top-level library modules
(``kvaddr/*.py``), never ``strategies``, ``measure``, ``traces``, ``gate``,
``commands`` or ``cli``.

Modules
-------
vllm            :class:`~kvaddr.engines.vllm.VllmStepPlanner`, vLLM Model Runner V2's
                input preparation (positions, seq_lens, slot mappings, gathered
                block tables, DCP local lengths) in one launch
vllm_bound      :class:`~kvaddr.engines.vllm_bound.BoundVllmStep`, the step bound to vLLM's
                persistent request state (``VllmStepPlanner.bind``): the batch checked per launch
vllm_mrv2       :class:`~kvaddr.engines.vllm_mrv2.Mrv2Addressing`, a drop-in for vLLM Model
                Runner V2's BlockTables and input preparation, served by the one launch
vllm_config     its configuration, output dataclass and host-side input checks
vllm_reference  the NumPy reference of the same contract (the oracle and the CPU path)
vllm_errors     its device error bits and :class:`VllmAddressingError`
spec_reference  the NumPy reference of speculative decoding's draft addressing
                (docs/spec-decode.md)
"""
