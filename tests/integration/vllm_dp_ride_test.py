#!/usr/bin/env python3
"""dpbalance_vllm.dp_ride against vLLM's own sync functions, with a stand-in only for the
collective (two ranks' all-reduce played by summing the other rank's column).

- vLLM 0.32.0's V1 `coordinate_batch_across_dp` (the real function and its `_run_ar`), with the
  record carried: vLLM's four rows come back as they would without it, every rank's bytes arrive
  exactly, in rank order; a later sync of the same step (nothing armed anywhere) leaves the
  step's records in place; a step with nothing armed here still carries the peer's bytes.
- The V2 runner's `sync_cudagraph_and_dp_padding` is wrapped the same way when this vLLM has it
  (its all-reduce needs a DP group: only the wrapping is checked).

  python tests/integration/vllm_dp_ride_test.py     (the vLLM venv's python)
"""
import os
import sys
import types
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "integration", "vllm"))

import torch  # noqa: E402

from dpbalance_vllm import dp_ride  # noqa: E402

DP = 2


class PeerSum:
    """torch.distributed's all_reduce as a DP = 2 group would do it, seen from rank `rank`: the
    peer's tensor is the same shape, holding its own column (`peer_col(rows)` fills it)."""

    def __init__(self, peer_col):
        self.peer_col = peer_col
        self.calls = []

    def all_reduce(self, tensor, group=None, **_):
        self.calls.append(tuple(tensor.shape))
        peer = torch.zeros_like(tensor)
        peer[:, 1] = self.peer_col(tensor.shape[0])
        tensor += peer

    def __getattr__(self, name):
        return getattr(torch.distributed, name)


class RideTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from vllm.v1.worker import dp_utils
        cls.dp_utils = dp_utils
        cls.width = 540
        # The peer (rank 1): vLLM's rows 0..3 = 7, 7, 0, 0; its carry = bytes 0..539 mod 251.
        cls.peer_bytes = bytes(i % 251 for i in range(cls.width))
        peer_carry = torch.frombuffer(bytearray(cls.peer_bytes), dtype=torch.int32)
        cls.armed_peer = [True]

        def peer_col(rows):
            col = torch.zeros(rows, dtype=torch.int32)
            col[0], col[1] = 7, 7
            if rows > 4 and cls.armed_peer[0]:
                col[4:4 + peer_carry.numel()] = peer_carry
            return col
        cls.fake = PeerSum(peer_col)
        dp_utils.dist = cls.fake  # the collective, below vLLM's code; dp_ride wraps it
        dp_utils._get_device_and_group = lambda pc: ("cpu", None)
        assert dp_ride.install(cls.width)
        cls.pc = types.SimpleNamespace(data_parallel_size=DP, data_parallel_rank=0,
                                       num_ubatches=2, disable_nccl_for_dp_synchronization=True)

    def sync(self, tokens):
        return self.dp_utils._synchronize_dp_ranks(tokens, tokens, False, 0, self.pc)

    def test_the_record_rides_and_vllms_rows_are_untouched(self):
        mine = bytes((3 * i + 1) % 256 for i in range(self.width))
        dp_ride.arm(mine)
        should_ubatch, padded, mode = self.sync(5)
        self.assertEqual(self.fake.calls[-1], (4 + self.width // 4, DP))
        self.assertFalse(should_ubatch)
        self.assertEqual(padded.tolist(), [5, 7])  # vLLM's tokens of both ranks, no padding
        self.assertEqual(mode, 0)
        got = dp_ride.take()
        self.assertEqual(got, mine + self.peer_bytes)
        # A later sync of the same step (a drafter's forward): nothing armed on either rank.
        self.armed_peer[0] = False
        self.sync(5)
        self.armed_peer[0] = True
        self.assertIsNone(dp_ride.take())  # the step's records stay the ones taken above

    def test_a_rank_with_nothing_armed_still_gets_the_peers_bytes(self):
        self.sync(3)
        got = dp_ride.take()
        self.assertEqual(got, bytes(self.width) + self.peer_bytes)
        self.assertGreaterEqual(dp_ride.counts()["syncs"], 1)

    def test_the_v2_runners_sync_is_wrapped_when_present(self):
        try:
            from vllm.v1.worker.gpu import dp_utils as v2
        except Exception as e:  # noqa: BLE001
            self.skipTest(f"this vLLM has no V2 runner sync to wrap here: {e}")
        self.assertTrue(hasattr(v2.sync_cudagraph_and_dp_padding, "__wrapped__"))
        self.assertIsInstance(v2.dist, dp_ride._RidingDist)


if __name__ == "__main__":
    unittest.main(verbosity=2)
