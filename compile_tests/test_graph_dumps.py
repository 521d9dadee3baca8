"""Pinned, normalized graph dumps of a 2-block fully_shard-ed transformer: the copies,
collectives and waits of Dynamo's graph and of AOTAutograd's forward and backward
graphs (Inductor's decompositions and min-cut partitioner), in graph order.

One compile on the fake process group serves every test. Regenerate the expected
strings after an intended change with ``EXPECTTEST_ACCEPT=1``.
"""

from __future__ import annotations

import expecttest
import torch

from compile_tests.sharded_model import data, make_model
from fsdp_traceable.introspection.capture import InductorCapture
from fsdp_traceable.introspection.fake_world import fake_process_group
from fsdp_traceable.introspection.graph import collective_sequence
from fsdp_traceable.testing import count_collectives


class TestGraphDumps(expecttest.TestCase):
    dynamo: list[str]
    forward: list[str]
    backward: list[str]

    @classmethod
    def setUpClass(cls) -> None:
        capture, dynamo_graphs = InductorCapture(inductor=False), []

        def backend(gm, example_inputs):
            dynamo_graphs.append(gm)
            return capture.backend(gm, example_inputs)

        with fake_process_group(2):
            loss = torch.compile(make_model().loss, backend=backend, fullgraph=True)(*data())
            loss.backward()
            (cls.dynamo_gm,) = dynamo_graphs
            cls.dynamo = collective_sequence(cls.dynamo_gm)
            cls.forward = collective_sequence(capture.forward)
            cls.backward = collective_sequence(capture.backward)
            cls.counts = (count_collectives(capture.forward), count_collectives(capture.backward))

    def test_dynamo_graph(self) -> None:
        # The root group (never resharded) is a plain autograd-function op; each block's
        # is wrapped in the must-recompute checkpoint. The backward bodies hold the
        # reduce-scatters that run when backward reaches the group.
        self.assertExpectedInline("\n".join(self.dynamo), """\
autograd_function_apply
  fwd_body:
    copy-in fsdp_traceable.all_gather_copy_in -> float32[4920]
    all_gather_into_tensor float32[4920] -> float32[9840]
    wait_tensor float32[9840]
    copy-out fsdp_traceable.all_gather_copy_out -> 4 tensors
  bwd_body:
    copy-in fsdp_traceable.reduce_scatter_copy_in -> float32[9840]
    reduce_scatter_tensor(avg) float32[9840] -> float32[4920]
    wait_tensor float32[4920]
    copy-out fsdp_traceable.reduce_scatter_view_out -> 4 tensors
tag_activation_checkpoint
  wrap_body:
    autograd_function_apply
      fwd_body:
        copy-in fsdp_traceable.all_gather_copy_in -> float32[10416]
        all_gather_into_tensor float32[10416] -> float32[20832]
        wait_tensor float32[20832]
        copy-out fsdp_traceable.all_gather_copy_out -> 9 tensors
      bwd_body:
        copy-in fsdp_traceable.reduce_scatter_copy_in -> float32[20832]
        reduce_scatter_tensor(avg) float32[20832] -> float32[10416]
        wait_tensor float32[10416]
        copy-out fsdp_traceable.reduce_scatter_view_out -> 9 tensors
tag_activation_checkpoint
  wrap_body:
    autograd_function_apply
      fwd_body:
        copy-in fsdp_traceable.all_gather_copy_in -> float32[10416]
        all_gather_into_tensor float32[10416] -> float32[20832]
        wait_tensor float32[20832]
        copy-out fsdp_traceable.all_gather_copy_out -> 9 tensors
      bwd_body:
        copy-in fsdp_traceable.reduce_scatter_copy_in -> float32[20832]
        reduce_scatter_tensor(avg) float32[20832] -> float32[10416]
        wait_tensor float32[10416]
        copy-out fsdp_traceable.reduce_scatter_view_out -> 9 tensors""")

    def test_aot_forward_graph(self) -> None:
        # One all-gather per group (root, block 0, block 1), each: one cat copy-in,
        # the collective, its wait, and the copy-out into one buffer: a cat of each
        # parameter's rank chunks (the clones), the parameters views of it.
        self.assertExpectedInline("\n".join(self.forward), """\
copy-in cat -> float32[4920]
all_gather_into_tensor float32[4920] -> float32[9840]
wait_tensor float32[9840]
copy-out clone x4, cat -> float32[9840]
copy-in cat -> float32[10416]
all_gather_into_tensor float32[10416] -> float32[20832]
wait_tensor float32[20832]
copy-out clone x9, cat -> float32[20832]
copy-in cat -> float32[10416]
all_gather_into_tensor float32[10416] -> float32[20832]
wait_tensor float32[20832]
copy-out clone x9, cat -> float32[20832]""")

    def test_aot_backward_graph(self) -> None:
        # Blocks in reverse: re-gather the block (recomputed, reshard_after_forward),
        # then reduce-scatter its gradients; the root's gradients last, no re-gather.
        self.assertExpectedInline("\n".join(self.backward), """\
copy-in cat -> float32[10416]
all_gather_into_tensor float32[10416] -> float32[20832]
wait_tensor float32[20832]
copy-out clone x9, cat -> float32[20832]
copy-in cat -> float32[20832]
reduce_scatter_tensor(avg) float32[20832] -> float32[10416]
wait_tensor float32[10416]
copy-out convert_element_type x9 -> 9 tensors
copy-in cat -> float32[10416]
all_gather_into_tensor float32[10416] -> float32[20832]
wait_tensor float32[20832]
copy-out clone x9, cat -> float32[20832]
copy-in cat -> float32[20832]
reduce_scatter_tensor(avg) float32[20832] -> float32[10416]
wait_tensor float32[10416]
copy-out convert_element_type x9 -> 9 tensors
copy-in cat -> float32[9840]
reduce_scatter_tensor(avg) float32[9840] -> float32[4920]
wait_tensor float32[4920]
copy-out convert_element_type x4 -> 4 tensors""")

    def test_collective_counts(self) -> None:
        # Dynamo's graph holds every group's all-gather and, in the autograd-function
        # backward bodies, its reduce-scatter.
        self.assertEqual(dict(count_collectives(self.dynamo_gm)),
                         {"all_gather": 3, "reduce_scatter": 3, "wait": 6})
        forward, backward = self.counts
        self.assertEqual(dict(forward), {"all_gather": 3, "wait": 3})
        self.assertEqual(dict(backward), {"all_gather": 2, "reduce_scatter": 3, "wait": 5})
