import errno
import os

import pytest
import torch

from farsight.config import ConfigError
from farsight.models import TransformerForCausalLM, load_model
from farsight.models.chunk_memory import ChunkMemory, DiskMemoryError, _PagedBuffer
from farsight.models.drt import DRTConfig, DRTForCausalLM

V = 40


def tiny(**kw):
    base = dict(vocab_size=V, d_model=32, n_layers=4, n_heads=2, chunk_size=5, window=12, top_k=2, encoder_layers=1)
    base.update(kw)
    torch.manual_seed(0)
    return DRTForCausalLM(DRTConfig(**base)).eval()


def ids(b, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V - 4, (b, n), generator=g)


@pytest.mark.parametrize("length", [1, 5, 23, 30])
def test_forward_returns_logits_for_real_tokens_only(length):
    model = tiny()
    x = ids(2, length)
    out = model(x, labels=x)
    assert out.logits.shape == (2, length, V)
    if length > 1:
        manual = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1))
        torch.testing.assert_close(out.loss, manual)


def test_slot_layout():
    model = tiny()
    slots = model.to_slots(torch.arange(1, 8)[None])
    lmk, pad = model.config.landmark_id, 0
    assert slots.tolist() == [[1, 2, 3, 4, 5, lmk, 6, 7, pad, pad, pad, lmk]]


@pytest.mark.parametrize("groups", [1, 2])
def test_chunk_causality(groups):
    model = tiny(groups=groups)
    x = ids(1, 40)
    base = model(x).logits
    for t in (1, 3, 5):  # change chunk t+1 onwards: logits of chunks <= t stay put
        y = x.clone()
        y[:, (t + 1) * 5 :] = (y[:, (t + 1) * 5 :] + 7) % (V - 4)
        out = model(y).logits
        torch.testing.assert_close(out[:, : (t + 1) * 5], base[:, : (t + 1) * 5], rtol=0, atol=0)
        assert not torch.allclose(out[:, (t + 1) * 5 :], base[:, (t + 1) * 5 :])


def test_encoder_never_mixes_chunks():
    model = tiny(encoder_layers=2)
    rows = torch.randn(2, 4, 6, 32)
    keys, k, v = model.encode_chunks(rows)
    changed = rows.clone()
    changed[:, 2] += 1.0
    keys2, k2, v2 = model.encode_chunks(changed)
    for a, b in ((keys, keys2), (k, k2), (v, v2)):
        torch.testing.assert_close(a[:, [0, 1, 3]], b[:, [0, 1, 3]], rtol=0, atol=0)
        assert not torch.allclose(a[:, 2], b[:, 2])


@pytest.mark.parametrize("groups", [1, 2])
def test_retrieval_candidates_are_earlier_chunks(groups):
    model = tiny(groups=groups, top_k=3)
    info = model(ids(2, 60), return_retrieval=True).retrieval
    assert len(info.indices) == groups
    for index, weight in zip(info.indices, info.weights):
        n = index.shape[1]
        for t in range(n):
            valid = index[:, t] >= 0
            assert int(valid.sum(-1).min()) == min(t, 3)
            assert bool((index[:, t][valid] < t).all())
            torch.testing.assert_close(weight[:, t].sum(-1), torch.full((2,), 1.0 if t else 0.0))


def test_gumbel_noise_only_in_training():
    model = tiny(top_k=1, chunk_size=2, window=3)
    x = ids(1, 80)
    a = model(x, return_retrieval=True).retrieval.indices[0]
    b = model(x, return_retrieval=True).retrieval.indices[0]
    assert torch.equal(a, b)
    model.train()
    draws = {tuple(model(x, return_retrieval=True).retrieval.indices[0].flatten().tolist()) for _ in range(4)}
    assert len(draws) > 1
    model.config.gumbel = False
    draws = {tuple(model(x, return_retrieval=True).retrieval.indices[0].flatten().tolist()) for _ in range(3)}
    assert len(draws) == 1


def test_softmax_off_by_one_changes_the_result():
    on = tiny(softmax_one=True)
    off = tiny(softmax_one=False)
    off.load_state_dict(on.state_dict())
    x = ids(1, 40)
    assert not torch.allclose(on(x).logits, off(x).logits)


def test_random_retriever_still_weights_by_learned_scores():
    model = tiny(retriever="random", top_k=2)
    x = ids(1, 50)
    a = model(x, return_retrieval=True).retrieval
    b = model(x, return_retrieval=True).retrieval
    assert not torch.equal(a.indices[0], b.indices[0])
    assert float(a.weights[0].detach().sum(-1)[:, 1:].min()) == pytest.approx(1.0)


def test_gradients_reach_the_retriever_encoder_and_lower_layers():
    model = tiny(groups=2).train()
    x = ids(2, 50)
    model(x, labels=x).loss.backward()
    for name in ("query_proj.0.weight", "query_proj.1.weight", "landmark_key.weight", "chunk_kv.weight"):
        grad = model.get_parameter(name).grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name
    for name, p in model.named_parameters():
        if name.startswith(("encoder.", "lower.")):
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_retrieval_weights_alone_carry_gradient_to_the_landmark_path():
    # W_h and W_l act only through the weights w = softmax(r): their gradient proves the path.
    model = tiny()
    model.train()
    x = ids(1, 40)
    model(x, labels=x).loss.backward()
    assert model.query_proj[0].weight.grad.abs().sum() > 0
    assert model.landmark_key.weight.grad.abs().sum() > 0


def test_no_retriever_equals_a_sliding_window_transformer():
    model = tiny(retriever="none")
    cfg = model.config.block_config()
    base = TransformerForCausalLM(cfg).eval()
    state = {
        "embed.weight": model.embed.weight,
        "norm.weight": model.norm.weight,
        "lm_head.weight": model.lm_head.weight,
    }
    for i, block in enumerate(model.layers()):
        for name, p in block.named_parameters():
            if not name.startswith("cross"):
                state[f"blocks.{i}.{name}"] = p
    base.load_state_dict(state)
    x = ids(2, 23)
    slots = model.to_slots(x)
    want = model.real_rows(base(slots).logits, 23)
    torch.testing.assert_close(model(x).logits, want)


# 262 and 247 tokens are 53 and 50 chunks: the device/host pages (16, 32, 64 chunks) fill and grow;
# the last field: the chunks read before and after each retrieved one
STREAM_CASES = [
    (30, 1, "device", (0, 0)),
    (28, 2, "device", (0, 0)),
    (33, 1, "host", (0, 0)),
    (25, 2, "disk", (0, 0)),
    (31, 2, "host", (0, 0)),
    (262, 2, "device", (0, 0)),
    (247, 1, "host", (0, 0)),
    (41, 2, "device", (1, 1)),
    (38, 1, "disk", (0, 2)),
    (131, 2, "host", (2, 1)),
]


@pytest.mark.parametrize("length,groups,memory,neighbors", STREAM_CASES)
def test_streaming_prefill_and_decode_equal_parallel_forward(length, groups, memory, neighbors, tmp_path):
    model = tiny(groups=groups, top_k=3, neighbors_before=neighbors[0], neighbors_after=neighbors[1])
    x = ids(2, length)
    full = model(x).logits
    prefix = 11
    path = tmp_path / "kv.bin" if memory == "disk" else None
    with model.new_session(batch_size=2, memory=memory, path=path, segment_chunks=1) as session:
        logits = [session.feed(x[:, :prefix])]
        logits += [session.step(x[:, i])[:, None] for i in range(prefix, length)]
    torch.testing.assert_close(torch.cat(logits, 1), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("memory", ["device", "host", "disk"])
def test_prefill_from_an_iterator_of_blocks(memory):
    model = tiny(top_k=2)
    x = ids(1, 47)
    want = model(x).logits[:, -1]
    with model.new_session(memory=memory, segment_chunks=3) as session:
        got = session.prefill(iter([x[0, :7], x[0, 7:8], x[0, 8:40], x[0, 40:]]))
        assert session.tokens_seen == 47
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_generate_matches_greedy_argmax_of_full_forward():
    model = tiny()
    prompt = ids(1, 12)
    out = model.generate(prompt, 9, temperature=0)
    logits = model(out).logits
    assert torch.equal(logits[:, 11:-1].argmax(-1), out[:, 12:])


def test_a_tiny_drt_learns():
    model = tiny().train()
    x = ids(4, 40)
    x[:, 20:] = x[:, :20]  # the second half repeats the first: retrievable
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_save_load_round_trip(tmp_path):
    model = tiny(groups=2)
    model.save_pretrained(tmp_path / "m")
    again = load_model(tmp_path / "m").eval()
    assert isinstance(again, DRTForCausalLM) and again.config == model.config
    x = ids(1, 17)
    torch.testing.assert_close(again(x).logits, model(x).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(top_k=0), "top_k"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(window=4), "smaller than a chunk"),
        (dict(groups=3), "cannot be split into groups"),
        (dict(retriever="bm25"), "retriever"),
        (dict(landmark_id=99), "landmark_id"),
        (dict(neighbors_before=-1), "neighbors_before must be an integer >= 0"),
        (dict(neighbors_after="two"), "neighbors_after must be an integer"),
    ],
)
def test_bad_configs(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        tiny(**kwargs)


def test_bad_token_ids():
    model = tiny()
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        model(torch.tensor([[1, V]]))
    with pytest.raises(ValueError, match="landmark token"):
        model(torch.tensor([[1, model.config.landmark_id]]))
    with model.new_session() as session, pytest.raises(ValueError, match="landmark token"):
        session.prefill(torch.tensor([[model.config.landmark_id]]))


def test_disk_tier_path_errors(tmp_path):
    model = tiny()
    with pytest.raises(DiskMemoryError, match="is a directory"):
        model.new_session(memory="disk", path=tmp_path)
    if os.geteuid() != 0:  # root can write anywhere
        locked = tmp_path / "ro"
        locked.mkdir()
        locked.chmod(0o500)
        with pytest.raises(DiskMemoryError, match="writable"):
            model.new_session(memory="disk", path=locked / "kv.bin")
    with pytest.raises(DiskMemoryError, match="writable"):
        model.new_session(memory="disk", path=tmp_path / "missing-dir" / "kv.bin")
    with model.new_session(memory="disk", path=tmp_path / "kv.bin"):
        with pytest.raises(DiskMemoryError, match="in use"):
            model.new_session(memory="disk", path=tmp_path / "kv.bin")
    with pytest.raises(ValueError, match="only used by memory='disk'"):
        model.new_session(memory="host", path=tmp_path / "kv.bin")


def test_disk_full_fails_cleanly(tmp_path, monkeypatch):
    memory = ChunkMemory("disk", torch.device("cpu"), tmp_path / "kv.bin")
    k = torch.randn(1, 3, 4, 2, 8)
    memory.append(torch.randn(1, 3, 16), k, k + 1)
    real = os.pwrite

    def full(fd, data, offset):
        real(fd, data[: len(data) // 2], offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(DiskMemoryError, match="3 chunks stored before are intact"):
        memory.append(torch.randn(1, 2, 16), k[:, :2], k[:, :2])
    monkeypatch.setattr(os, "pwrite", real)
    assert os.path.getsize(tmp_path / "kv.bin") == 3 * memory.store._record
    got_k, got_v, index = memory.fetch(torch.tensor([[[2, 0]]]))
    torch.testing.assert_close(got_k[:, index[0, 0]], k[:, [2, 0]])
    torch.testing.assert_close(got_v[:, index[0, 0]], k[:, [2, 0]] + 1)
    memory.close()


def test_paged_buffer_grows_without_copying_and_gathers_across_pages():
    buffer = _PagedBuffer(torch.device("cpu"))
    rows = torch.randn(2, 100, 3)
    buffer.append(rows[:, :10])
    first_page = buffer.pages[0].data_ptr()
    for start, stop in ((10, 17), (17, 60), (60, 100)):  # appends that straddle page ends
        buffer.append(rows[:, start:stop])
    assert buffer.pages[0].data_ptr() == first_page
    assert [page.shape[1] for page in buffer.pages] == [16, 32, 64]
    ids = torch.tensor([0, 15, 16, 47, 48, 99])
    torch.testing.assert_close(buffer.gather(ids), rows[:, ids], rtol=0, atol=0)
    assert buffer.nbytes() == rows.numel() * rows.element_size()


@pytest.mark.parametrize(
    "memory, screen, native",
    [
        ("graph", "bf16", True),
        ("device", "bf16", True),
        ("disk", "bf16", True),
        ("device", "lowrank", False),
        ("disk", "lowrank", False),
        ("disk", "lowrank", True),
    ],
)
def test_screened_retrieval_equals_scoring_every_key(memory, screen, native, monkeypatch):
    """A screen (farsight.ops.retrieval: low-rank where the keys have a basis, else bf16 where
    bf16 GEMMs are native) used for every retrieval, in fp64 and with left padding, retrieves
    what scoring every key does and gives the same logits."""
    import farsight.ops.retrieval as retrieval
    import farsight.ops.retrieval.groups as groups
    import farsight.ops.retrieval.lowrank as lowrank

    monkeypatch.setattr(retrieval, "native_bf16_matmul", lambda device: native)
    screened = []
    if screen == "lowrank":
        # an untrained model's keys have no low-rank basis: take any rank-8 one and rescore every
        # group the bound keeps, so that the screen runs for every retrieval
        monkeypatch.setattr(lowrank, "RESIDUAL_ENERGY", 1.0)
        monkeypatch.setattr(groups, "RESCORE_LIMIT", 1)
        monkeypatch.setattr(retrieval, "LOW_RANK_MIN_KEYS", 1)
        monkeypatch.setattr(retrieval, "LOW_RANK_OVER_BF16_KEYS", 1)

        def counted(*args):
            screened.append(args[1].shape[1])
            return lowrank.retrieval_topk_lowrank(*args)

        monkeypatch.setattr(retrieval, "retrieval_topk_lowrank", counted)
    model = tiny(groups=2, top_k=3).double()
    x = ids(2, 203)
    mask = torch.ones_like(x)
    mask[1, :9] = 0
    results = []
    for min_keys in (10**9, 1):
        monkeypatch.setattr(retrieval, "SCREEN_MIN_KEYS", min_keys)
        if memory == "graph":
            out = model(x, attention_mask=mask, return_retrieval=True)
            results.append((out.logits[mask.bool()], out.retrieval))
            continue
        with model.new_session(batch_size=2, memory=memory, segment_chunks=4, record_retrieval=True) as session:
            logits = torch.cat(
                [session.prefill(x[:, :150], attention_mask=mask[:, :150])[:, None]]
                + [session.step(x[:, i])[:, None] for i in range(150, 203)],
                1,
            )
            results.append((logits, session.retrievals))
    (ref_logits, ref_info), (logits, info) = results
    assert len(screened) == (0 if screen == "bf16" else 2 * 17)  # 2 groups x the chunks after the first
    for ref_index, index in zip(ref_info.indices, info.indices):
        assert torch.equal(ref_index.sort(-1).values, index.sort(-1).values)
    for ref_weight, weight in zip(ref_info.weights, info.weights):
        torch.testing.assert_close(weight.sort(-1).values, ref_weight.sort(-1).values, atol=1e-12, rtol=0)
    torch.testing.assert_close(logits, ref_logits, atol=1e-10, rtol=0)


def test_chunk_memory_keeps_bf16_keys_and_a_norm_bound(monkeypatch):
    import farsight.ops.retrieval as retrieval

    monkeypatch.setattr(retrieval, "native_bf16_matmul", lambda device: True)
    memory = ChunkMemory("host", torch.device("cpu"))
    keys = torch.randn(1, 5, 8)
    memory.append(keys[:, :3], torch.zeros(1, 3, 2, 1, 4), torch.zeros(1, 3, 2, 1, 4))
    memory.append(keys[:, 3:], torch.zeros(1, 2, 2, 1, 4), torch.zeros(1, 2, 2, 1, 4))
    state = memory.screen_state()
    assert set(state) == {
        "keys_low",
        "max_key_norm",
        "low_rank",
    }  # the low-rank screen first, where the keys have a basis
    low, bound = state["keys_low"], state["max_key_norm"]
    assert torch.equal(low, keys.bfloat16())
    torch.testing.assert_close(bound, keys.norm(dim=-1).max())
    memory.truncate(2)
    low, bound = memory.screen_state()["keys_low"], memory.screen_state()["max_key_norm"]
    assert low.shape[1] == 2 and bound >= keys[:, :2].norm(dim=-1).max()
    assert ChunkMemory("graph", torch.device("cpu")).screen_state() == {}


def test_chunk_memory_keeps_no_bf16_keys_where_the_bf16_screen_does_not_pay(monkeypatch):
    # without bf16 matrix instructions the bf16 screen is slower than scoring every key in fp32,
    # so its copy of the keys would only cost memory
    import farsight.ops.retrieval as retrieval

    monkeypatch.setattr(retrieval, "native_bf16_matmul", lambda device: False)
    memory = ChunkMemory("host", torch.device("cpu"))
    keys = torch.randn(1, 5, 8)
    memory.append(keys, torch.zeros(1, 5, 2, 1, 4), torch.zeros(1, 5, 2, 1, 4))
    assert list(memory.screen_state()) == ["low_rank"]
    assert torch.equal(memory.landmark_keys(), keys)
    assert memory.nbytes() == keys.numel() * 4 + 2 * 5 * 2 * 4 * 4


def test_chunk_memory_of_bf16_keys_screens_the_keys_themselves(monkeypatch):
    # bf16 keys are their own bf16 screen: a copy would double the keys' memory (128 MB at 16M tokens)
    import farsight.ops.retrieval as retrieval

    monkeypatch.setattr(retrieval, "native_bf16_matmul", lambda device: True)
    memory = ChunkMemory("host", torch.device("cpu"))
    keys = torch.randn(1, 5, 8, dtype=torch.bfloat16)
    memory.append(
        keys, torch.zeros(1, 5, 2, 1, 4, dtype=torch.bfloat16), torch.zeros(1, 5, 2, 1, 4, dtype=torch.bfloat16)
    )
    low = memory.screen_state()["keys_low"]
    assert torch.equal(low, keys) and low.data_ptr() == memory.landmark_keys().data_ptr()
    torch.testing.assert_close(memory.screen_state()["max_key_norm"], keys.float().norm(dim=-1).max())
    assert memory.nbytes() == keys.numel() * 2 + 2 * 5 * 2 * 4 * 2


@pytest.mark.parametrize("tier", ["device", "host"])
def test_closing_a_chunk_memory_frees_its_landmark_keys(tier):
    # a closed session may live on until the garbage collector finds it; its keys must not
    memory = ChunkMemory(tier, torch.device("cpu"))
    memory.append(torch.randn(1, 300, 8), torch.zeros(1, 300, 2, 1, 4), torch.zeros(1, 300, 2, 1, 4))
    assert memory.nbytes() > 300 * 8 * 4
    memory.close()
    assert memory.n_chunks == 0 and memory.nbytes() == 0
