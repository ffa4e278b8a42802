"""One-process tests of the wire layouts and the hyper-parameter codec: round trips, alignment."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mpisync.protocol import pooled
from mpisync.protocol.hyper import HyperCodec
from mpisync.protocol.rowsmsg import absent_parts, pack_rows, unpack_rows
from mpisync.protocol.wire import (
    ALIGN,
    FLAG_ASSIGN,
    FLAG_RESEND,
    NOTICE_SKIPPED,
    NOTICE_WORDS,
    PARAM_HEADER_BYTES,
    ROWS_HEAD,
    TIMING_WORDS,
    TOKEN_STATS,
    TOKEN_WORDS,
    Control,
    ControlField,
    GradField,
    GradHeader,
    HyperField,
    Kind,
    NoticeField,
    ParamField,
    RowsField,
    Tag,
    TimingWord,
    TokenField,
    build_layouts,
    hyper_views,
    hyper_words,
    rows_mark,
    tensor_view,
    timing_view,
)


# -- layouts ------------------------------------------------------------------------------
def test_layouts_group_by_dtype_in_aligned_contiguous_regions():
    names = ["a", "b", "c", "d", "e"]
    shapes = [(3, 5), (7,), (), (2, 2), (1,)]
    dtypes = [torch.float32, torch.float64, torch.float32, torch.int64, torch.float64]
    owners = (0, 1, 0, 0, 1)
    layouts = build_layouts(names, shapes, dtypes, owners, 2,
                            buffers=(("bn.mean", (4,), torch.float32, 1),
                                     ("bn.count", (), torch.int64, 1)))
    ps0, ps1 = layouts
    assert [e.name for e in ps0.entries] == ["a", "c", "d"]      # float32 first, then int64
    assert [e.name for e in ps1.entries] == ["b", "e"]
    assert [e.name for e in ps1.buffer_entries] == ["bn.mean", "bn.count"]
    for layout in layouts:
        ends = 0
        for dtype, offset, nbytes in layout.regions + layout.buffer_regions:
            assert offset % ALIGN == 0 and offset >= ends
            inside = [e for e in layout.entries + layout.buffer_entries
                      if offset <= e.offset < offset + nbytes]
            assert all(e.dtype == dtype for e in inside)
            assert sum(e.nbytes for e in inside) == nbytes          # contiguous, no gaps
            ends = offset + nbytes
        assert layout.nbytes % ALIGN == 0 and layout.nbytes >= ends
    c = next(e for e in ps0.entries if e.name == "c")
    assert c.shape == () and c.nbytes == 4
    # buffers come after the parameters
    assert min(e.offset for e in ps1.buffer_entries) >= max(e.offset + e.nbytes
                                                            for e in ps1.entries)


def test_layouts_are_the_same_whoever_builds_them():
    args = (["x", "y"], [(4, 4), (3,)], [torch.float32, torch.bfloat16], (1, 0), 2)
    assert build_layouts(*args) == build_layouts(*args)


def test_views_of_a_layout_read_back_what_was_written():
    layout = build_layouts(["w", "b"], [(2, 3), (3,)], [torch.float64, torch.float16],
                           (0, 0), 1)[0]
    buf = torch.zeros(64 + layout.nbytes, dtype=torch.uint8)
    values = {"w": torch.randn(2, 3, dtype=torch.float64), "b": torch.randn(3).half()}
    for e in layout.entries:
        tensor_view(buf, 64, e.dtype, e.offset, e.nbytes, e.shape).copy_(values[e.name])
    for e in layout.entries:
        assert torch.equal(tensor_view(buf, 64, e.dtype, e.offset, e.nbytes, e.shape),
                           values[e.name])


# -- headers ------------------------------------------------------------------------------
@pytest.mark.parametrize("width, entries", [(0, 0), (0, 5), (3, 1), (17, 9)])
def test_grad_header_fields_do_not_overlap_and_are_aligned(width, entries):
    header = GradHeader(width, entries)
    assert header.nbytes % ALIGN == 0
    buf = np.zeros(header.nbytes, np.uint8)
    fields, words, codes, mask = header.views(buf)
    assert (len(fields), len(words), len(codes), len(mask)) == (8, width, width, entries)
    fields[:] = -1
    words[:] = 7
    codes[:] = 3
    mask[:] = 1
    assert int(buf.sum()) == 8 * 8 * 255 + width * 7 + width * 3 + entries


def test_control_messages_round_trip():
    control = Control(num_workers=4, hyper_width=3)
    words = np.array([1, -2, 3 << 40], np.int64)
    codes = np.array([1, 2, 17], np.uint8)
    msg = control.new(Kind.DECIDE, 12, arg=2, taken=(1, 0, 2, 1), workers=(0, 3),
                      hyper=(words, codes), has_obj=True)
    assert (int(msg[ControlField.KIND]), int(msg[ControlField.STEP]),
            int(msg[ControlField.ARG]), int(msg[ControlField.HAS_OBJ])) == (Kind.DECIDE, 12, 2, 1)
    assert control.taken(msg) == (1, 0, 2, 1)
    assert list(control.workers(msg)) == [0, 3]
    got_words, got_codes = control.hyper(msg)
    assert list(got_words) == list(words) and list(got_codes) == list(codes)
    assert msg.nbytes == 8 * control.words


# -- header fields by name: the bytes on the wire (WIRE_VERSION 5) ---------------------------
def _positions(cls) -> dict[str, int]:
    return {k: v for k, v in vars(cls).items() if k.isupper()}


@pytest.mark.parametrize("cls, count", [(GradField, 8), (ParamField, 8), (TokenField, 4),
                                        (NoticeField, 8), (ControlField, 4), (RowsField, 3),
                                        (TimingWord, 4)])
def test_each_field_has_its_own_position_inside_the_header(cls, count):
    fields = _positions(cls)
    assert fields.pop("COUNT") == count
    if cls is RowsField:
        assert fields.pop("MARK") == RowsField.STEP       # the same word, two readings
    if cls is GradField:
        assert fields.pop("TIMING_STOP") == GradField.TIMING + 4 * TIMING_WORDS // 8   # uint32s
    positions = sorted(fields.values())
    assert positions == sorted(set(positions)) and 0 <= positions[0]
    assert positions[-1] < count
    assert all(type(v) is int for v in fields.values())    # plain ints: cheap to index with


def test_sizes_follow_the_fields():
    assert PARAM_HEADER_BYTES == 64 and TOKEN_WORDS == 4 and NOTICE_WORDS == 8
    assert ROWS_HEAD == 3 and TIMING_WORDS == 4 and GradHeader.FIELDS == 8


def test_grad_header_by_name_is_the_bytes_of_version_3():
    header = GradHeader(hyper_width=2, num_entries=3)
    buf = np.zeros(header.nbytes, np.uint8)
    fields, _, _, _ = header.views(buf)
    fields[GradField.KIND], fields[GradField.STEP] = Kind.GRAD, 41
    fields[GradField.WORKER], fields[GradField.SEQ] = 3, 40
    fields[GradField.FLAGS] = FLAG_ASSIGN | FLAG_RESEND
    timing = timing_view(fields)
    timing[TimingWord.COMPUTE], timing[TimingWord.PUSH] = 1000, 20
    timing[TimingWord.WAIT], timing[TimingWord.PULL] = 300, 0xFFFFFFFF
    expected = np.array([Kind.GRAD, 41, 3, 40, 5, 1000 | 20 << 32, 300 | 0xFFFFFFFF << 32, 0],
                        np.uint64).view(np.int64)
    assert buf[:64].tobytes() == expected.tobytes()
    got = header.views(buf)[0]
    assert [int(got[GradField.KIND]), int(got[GradField.STEP]), int(got[GradField.WORKER]),
            int(got[GradField.SEQ]), int(got[GradField.FLAGS])] == [Kind.GRAD, 41, 3, 40, 5]
    assert timing_view(got).tolist() == [1000, 20, 300, 0xFFFFFFFF]


def test_close_carries_the_timings_where_a_gradient_does():
    bye = np.zeros(GradField.COUNT, np.int64)
    bye[GradField.KIND], bye[GradField.STEP], bye[GradField.WORKER] = Kind.CLOSE, 9, 1
    timing_view(bye)[:] = (4, 3, 2, 1)
    assert bye.tobytes() == np.array([Kind.CLOSE, 9, 1, 0, 0, 4 | 3 << 32, 2 | 1 << 32, 0],
                                     np.int64).tobytes()


def test_param_header_by_name_is_the_bytes_of_version_3():
    buf = np.zeros(PARAM_HEADER_BYTES + 16, np.uint8)
    fields = buf[:PARAM_HEADER_BYTES].view(np.int64)
    fields[ParamField.KIND], fields[ParamField.STEP] = Kind.PARAMS, 7
    assert buf[:PARAM_HEADER_BYTES].tobytes() == np.array(
        [Kind.PARAMS, 7, 0, 0, 0, 0, 0, 0], np.int64).tobytes()
    assert int(fields[ParamField.STEP]) == 7


def test_token_by_name_is_the_bytes_of_version_3():
    token = np.zeros(TOKEN_WORDS, np.int64)
    token[TokenField.KIND], token[TokenField.STEP], token[TokenField.ARG] = Kind.GO, 12, 1
    token[TokenField.FLAGS] = TOKEN_STATS
    assert token.tobytes() == np.array([Kind.GO, 12, 1, TOKEN_STATS], np.int64).tobytes()
    assert (int(token[TokenField.KIND]), int(token[TokenField.STEP]),
            bool(token[TokenField.ARG])) == (Kind.GO, 12, True)


def test_notice_by_name_is_the_bytes_of_version_3():
    notice = np.zeros(NOTICE_WORDS, np.int64)
    notice[NoticeField.KIND], notice[NoticeField.STEP] = Kind.APPLIED, 5
    notice[NoticeField.SENDER], notice[NoticeField.FLAGS] = 2, NOTICE_SKIPPED
    notice[NoticeField.APPLY_US], notice[NoticeField.REDUCE_US] = 1500, 500
    notice[NoticeField.BYTES_IN], notice[NoticeField.BYTES_OUT] = 4096, 2048
    assert notice.tobytes() == np.array([Kind.APPLIED, 5, 2, NOTICE_SKIPPED, 1500, 500, 4096,
                                         2048], np.int64).tobytes()


def test_control_by_name_is_the_bytes_of_version_3():
    control = Control(num_workers=2, hyper_width=1)
    msg = control.new(Kind.STATE, 3, arg=1, has_obj=True)
    assert msg.tobytes() == np.array([Kind.STATE, 3, 1, 1, 0, 0, 0, 0, 0, 0],
                                     np.int64).tobytes()


def test_hyper_message_by_name_is_the_bytes_of_version_3():
    width = 3
    msg = np.zeros(hyper_words(width), np.int64)
    msg[HyperField.STEP] = 8
    words, codes = hyper_views(msg, width)
    words[:], codes[:] = (10, -20, 30), (1, 2, 3)
    assert len(msg) == 1 + width + 1
    assert msg.tobytes() == np.array([8, 10, -20, 30, 1 | 2 << 8 | 3 << 16], np.int64).tobytes()
    got_words, got_codes = hyper_views(msg, width)
    assert got_words.tolist() == [10, -20, 30] and got_codes.tolist() == [1, 2, 3]


def test_rows_head_by_name_is_the_bytes_of_version_4():
    ids = torch.tensor([4, 5], dtype=torch.int64)
    buf = pack_rows(6, 2, [(ids, None), (None, None)])
    assert buf.tobytes() == np.array([6, 2, 2, 2, 0, 4, 5], np.int64).tobytes()
    assert unpack_rows(buf, [None, None], with_ids=True)[:2] == (6, 2)
    assert rows_mark(buf) == 6 and rows_mark(buf[:7]) is None


def test_a_part_of_no_gradient_is_counted_minus_one_and_read_as_empty():
    """A push's part whose table had no gradient at all (not one without rows here)."""
    ids, values = torch.tensor([4, 5]), torch.ones(2, 3)
    empty = (torch.empty(0, dtype=torch.int64), torch.empty(0, 3))
    buf = pack_rows(6, 2, [(ids, values), empty, empty], [False, False, True])
    assert buf[:48].view(np.int64).tolist() == [6, 2, 3, 2, 0, -1]
    assert absent_parts(buf) == [False, False, True]
    kinds = [(torch.float32, (3,))] * 3
    _, _, parts = unpack_rows(buf, kinds, with_ids=True)
    assert torch.equal(parts[0][0], ids) and torch.equal(parts[0][1], values)
    assert all(len(p[0]) == 0 and p[1].shape == (0, 3) for p in parts[1:])
    assert pooled.rows_section_nbytes(buf, kinds) == len(buf)


def test_pooled_head_by_name_is_the_bytes_of_version_4():
    buf = pooled.pack_parts(pooled.EXCHANGE, [None], [])
    assert buf.tobytes() == np.array([pooled.EXCHANGE, 0, 1, 0, -1, 0], np.int64).tobytes()
    assert rows_mark(buf) == pooled.EXCHANGE
    assert pooled.unpack_parts(buf, [torch.float32])[:2] == (pooled.EXCHANGE, [None])


def test_tags_of_optimizers_never_collide():
    seen = set()
    for opt_id in range(50):
        for tag in range(Tag._STRIDE):
            t = Tag.of(tag, opt_id)
            assert t not in seen and t not in (Tag.SETUP, Tag.DONE, Tag.ERROR)
            seen.add(t)
    assert max(seen) < 32767                 # the smallest MPI_TAG_UB the standard allows


# -- hyper-parameters ---------------------------------------------------------------------
def round_trip(codec: HyperCodec, groups: list[dict], into: list[dict]) -> list[dict]:
    words, codes = codec.values(groups)
    codec.decode(words, codes, into)
    return into


def test_every_value_type_arrives_exactly_with_its_type():
    groups = [{"params": [], "lr": 1, "momentum": 0, "nesterov": False, "eps": 1e-8,
               "betas": (0.9, torch.tensor(0.999, dtype=torch.float64)),
               "t": torch.tensor(0.1, dtype=torch.float32), "i": torch.tensor(3),
               "bf": torch.tensor(0.3, dtype=torch.bfloat16), "foreach": None, "name": "x"}]
    codec = HyperCodec.from_groups(groups)
    assert codec.width == 9
    assert [s[1] for s in codec.fixed] == ["foreach", "name"]
    # a scheduler turns the int lr into a float, the momentum too, and fills the tensor
    groups[0]["lr"] = 0.5
    groups[0]["momentum"] = 0.85
    groups[0]["t"].fill_(0.025)
    groups[0]["nesterov"] = True
    groups[0]["betas"] = (0.95, torch.tensor(0.99, dtype=torch.float64))
    ps_tensor = torch.tensor(0.0, dtype=torch.float32)
    into = [{"lr": 1, "momentum": 0, "t": ps_tensor}]
    got = round_trip(codec, groups, into)[0]
    assert got["lr"] == 0.5 and type(got["lr"]) is float
    assert got["momentum"] == 0.85 and type(got["momentum"]) is float
    assert got["nesterov"] is True
    assert got["eps"] == 1e-8
    assert got["t"] is ps_tensor and got["t"].item() == groups[0]["t"].item()   # in place
    assert got["t"].dtype == torch.float32
    assert got["i"].dtype == torch.int64 and got["i"].item() == 3
    assert got["bf"].dtype == torch.bfloat16 and got["bf"].item() == groups[0]["bf"].item()
    assert type(got["betas"]) is tuple and got["betas"][0] == 0.95
    assert got["betas"][1].dtype == torch.float64 and got["betas"][1].item() == 0.99


@pytest.mark.parametrize("value", [0.1, 1 / 3, 1e-300, -0.0, math.inf, 2 ** 62, -7, True])
def test_numbers_round_trip_bit_for_bit(value):
    codec = HyperCodec.from_groups([{"params": [], "v": value}])
    got = round_trip(codec, [{"v": value}], [{}])[0]["v"]
    assert type(got) is type(value) and got == value
    assert math.copysign(1, got) == math.copysign(1, value)


def test_nan_round_trips():
    codec = HyperCodec.from_groups([{"params": [], "v": 0.0}])
    assert math.isnan(round_trip(codec, [{"v": math.nan}], [{}])[0]["v"])


def test_lists_stay_lists_and_lengths_must_not_change():
    codec = HyperCodec.from_groups([{"params": [], "etas": [0.5, 1.2]}])
    assert round_trip(codec, [{"etas": [0.4, 1.1]}], [{}])[0]["etas"] == [0.4, 1.1]
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['etas'\] must stay a list of 2"):
        codec.values([{"etas": [0.4]}])


def test_changes_that_cannot_travel_are_named():
    codec = HyperCodec.from_groups([{"params": [], "lr": 0.1, "foreach": None}])
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['lr'\] must stay a number, "
                                        r"found 'fast'"):
        codec.values([{"lr": "fast", "foreach": None}])
    with pytest.raises(TypeError, match=r"must stay a number or a one-element tensor, found "
                                        r"a tensor of shape \[2\]"):
        codec.values([{"lr": torch.ones(2), "foreach": None}])
    with pytest.raises(TypeError, match=r"\['foreach'\] changed from None to True"):
        codec.values([{"lr": 0.1, "foreach": True}])


def test_keys_added_later_stay_on_the_worker():
    codec = HyperCodec.from_groups([{"params": [], "lr": 0.1}])
    into = [{}]
    round_trip(codec, [{"lr": 0.2, "initial_lr": 0.1}], into)
    assert into == [{"lr": 0.2}]
