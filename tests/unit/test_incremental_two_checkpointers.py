"""Two Checkpointers on one optimizer saving at different steps: each reads (and clears)
the ps ranks' changed-row marks, so the incremental files of one must not silently miss
the rows the other's save consumed. Either the second Checkpointer is refused, or every
file of each chain loads bitwise as a full file of its step."""
from __future__ import annotations

import pytest
from test_incremental_checkpoint import build, ckpt_name, rank, record, same, train_step  # noqa: F401

import mpisync

pytestmark = pytest.mark.filterwarnings("ignore:.*were written after the last step")


def test_a_second_checkpointer_never_makes_the_first_ones_files_wrong(rank, tmp_path):  # noqa: F811
    net, opt = build(rank, "adagrad")
    a = mpisync.Checkpointer(tmp_path / "a", net, opt, every_steps=3, full_every=4)
    try:
        b = mpisync.Checkpointer(tmp_path / "b", net, opt, every_steps=2, full_every=4)
    except (ValueError, mpisync.ConfigError):
        opt.close()
        return                                  # refused: fine
    for t in range(6):
        train_step(net, opt, t)
        a.maybe_save()
        b.maybe_save()
    mpisync.save(tmp_path / "full6.pt", net, opt)
    opt.close()
    net2, opt2 = build(rank, "adagrad", seed=7)
    mpisync.load(tmp_path / "a" / ckpt_name(6), net2, opt2)
    chained = record(net2, opt2)
    mpisync.load(tmp_path / "full6.pt", net2, opt2)
    same(chained, record(net2, opt2), "a's incremental file of step 6 and a full file")
    opt2.close()
