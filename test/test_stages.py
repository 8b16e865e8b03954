"""Stage keys, round trip and exact resume, on real gloo ranks."""

import json
from collections import Counter

import pytest
from ranks import run_checks

import pippy_dcp
from gpt import GPT, ModelArgs


def results(out, check, world_size):
    return [
        json.loads((out / f"{check}-rank{r}.json").read_text())
        for r in range(world_size)
    ]


def full_model_keys():
    args = pippy_dcp.parse_args(["--n-layers", "4", "--dim", "32", "--seq-len", "32"])
    model = GPT(ModelArgs(n_layers=4, dim=32, max_seq_len=args.seq_len))
    return set(model.state_dict())


def optim_fqn(key):
    """``state.<fqn>.<name>`` or ``scalars.<fqn>``: the parameter's FQN."""
    section, rest = key.split(".", 1)
    return rest if section == "scalars" else rest.rsplit(".", 1)[0]


def launched(request, tmp_path, check, world_size):
    """The folder of a launch that ran `check` on `world_size` ranks: 2 and 4
    ranks share a launch with other checks (conftest.py), 1 rank runs alone."""
    if world_size == 1:
        return run_checks(1, {"dist_checks": [check]}, tmp_path)["dist_checks"]
    shared = {2: "two_rank_checks", 4: "four_rank_checks"}[world_size]
    return request.getfixturevalue(shared)["dist_checks"]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_stage_keys_are_disjoint_and_cover_the_model(request, tmp_path, world_size):
    out = launched(request, tmp_path, "keys", world_size)
    ranks = results(out, "keys", world_size)
    expected = full_model_keys()
    assert "rope" not in expected  # non-persistent in the un-split model
    for split in ("manual", "trace"):
        model_keys = [set(r[split]["model"]) for r in ranks]
        assert sum(map(len, model_keys)) == len(set().union(*model_keys)), split
        assert set().union(*model_keys) == expected, split
        # Optimizer state is keyed by the FQNs of the parameters the stage owns.
        optim_keys = [set(r[split]["optim"]) for r in ranks]
        assert sum(map(len, optim_keys)) == len(set().union(*optim_keys)), split
        for keys, owned in zip(optim_keys, model_keys, strict=True):
            fqns = {optim_fqn(k) for k in keys}
            assert fqns == owned, split
    if world_size > 1:
        error = ranks[0]["renumbered_error"]
        assert error is not None and "'model.layers.0.attn_norm.weight'" in error
        assert all(r["renumbered_error"] == error for r in ranks)
        for check, key in [
            ("traced_buffer_error", "'model.rope'"),
            ("traced_tie_error", "'model.output.weight'"),
        ]:
            error = ranks[0][check]
            assert error is not None and key in error, check
            assert all(r[check] == error for r in ranks)
        error = ranks[0]["per_rank_error"]
        each = " vs ".join(f"[{r}]" for r in range(world_size))
        assert error is not None and f"'rng.state' (ranks {each})" in error
        if world_size == 4:
            assert "'data.drawn' (ranks [0, 3] vs [1, 2])" in ranks[0]["ends_error"]
        assert all(r["per_rank_error"] == error for r in ranks)
        error = ranks[0]["scheduler_error"]  # pippy's key: the fix is the groups
        assert error is not None and error.endswith(
            "Give every stage the same param groups (in number and options), so "
            "that the LR scheduler's per-group lists agree."
        )
        assert all(r["scheduler_error"] == error for r in ranks)
        for r in ranks:  # not "differ between ranks": cannot be saved at all
            assert r["lambda_error"].startswith(
                "'cfg.fn' cannot be saved: DCP pickles an entry that is not a "
                "tensor, and this function cannot be pickled"
            )
    else:
        assert ranks[0]["per_rank_error"] is ranks[0]["scheduler_error"] is None


@pytest.mark.parametrize("world_size", [2, 4])
def test_round_trip_and_exact_resume(request, tmp_path, world_size):
    out = launched(request, tmp_path, "train", world_size)
    ranks = results(out, "train", world_size)
    for schedule in ("gpipe", "1f1b"):
        for rank, r in enumerate(ranks):
            r = r[schedule]
            # Fresh stages (other seed) differ before the load, so the
            # comparisons below can fail.
            assert any(k.startswith("model.") for k in r["differ_before_load"])
            assert r["differ_after_load"] == [], (schedule, rank)
            assert r["differ_final"] == [], (schedule, rank)
            assert r["losses_a"] == r["losses_b"], (schedule, rank)
            is_last = rank == world_size - 1
            assert all((x is not None) == is_last for x in r["losses_a"])


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_tied_weights_split_over_stages_are_refused_where_the_stage_is_built(name):
    import pippy
    from pippy.stages import TiedParametersError

    from helpers import HF_SPLIT, hf_config, hf_model_class

    config, cls = hf_config(name), hf_model_class(name)
    config.tie_word_embeddings = True
    embedding = {"llama": "model.embed_tokens.weight", "gpt2": "transformer.wte.weight"}
    for stage_index in (0, 1):  # the first stage keeps the one, the last the other
        with pytest.raises(TiedParametersError) as e:
            pippy.build_stage_module(
                lambda: cls(config), stage_index, 2, device="cpu", **HF_SPLIT[name]
            )
        kept, other = (
            (embedding[name], "lm_head.weight")
            if stage_index == 0
            else ("lm_head.weight", embedding[name])
        )
        assert str(e.value) == (
            f"{other!r} is tied to {kept!r}, but stage {stage_index} of 2 keeps only "
            f"{kept!r}: split, the two would train as separate copies. Untie them "
            "(Hugging Face: tie_word_embeddings=False), or keep both on one stage"
        )
    with pytest.raises(TiedParametersError):  # split_model refuses it too
        pippy.split_model(cls(config), 0, 2, **HF_SPLIT[name])
    # One stage keeps both names of the tie: nothing to refuse.
    module = pippy.build_stage_module(
        lambda: cls(config), 0, 1, device="cpu", **HF_SPLIT[name]
    )
    assert module.lm_head.weight is module.get_parameter(embedding[name])


#: What pippy's save and load add, at most, to the operations of a plain
#: dcp.save / dcp.load of the same state, counted on each rank (the collectives
#: through torch.distributed, and the c10d store operations of its waits):
#: none on a save (its key check and its staging folder travel in DCP's own
#: planning), one broadcast on a load (the step's index from rank 0; its
#: applying travels in DCP's own last gather); no store operation: the waits
#: talk through the store only once a save or load outlasts an interval
#: (progress records included).
EXTRA_COLLECTIVES = {"save_stage": 0, "load_stage": 1}
EXTRA_STORE_OPS = {"save_stage": 0, "load_stage": 0}


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_save_and_a_load_add_few_operations_to_plain_dcp(request, world_size):
    ranks = results(launched(request, None, "ops", world_size), "ops", world_size)
    plain = {"save_stage": "dcp.save", "load_stage": "dcp.load"}
    for rank, counted in enumerate(ranks):
        for ours, theirs in plain.items():
            collectives = {k: n for k, n in counted[ours].items() if "." not in k}
            store = sum(n for k, n in counted[ours].items() if k.startswith("store."))
            assert not any(k.startswith("store.") for k in counted[theirs])
            extra = Counter(collectives) - Counter(counted[theirs])
            assert extra.total() <= EXTRA_COLLECTIVES[ours], (rank, ours, counted)
            assert set(extra) <= {"broadcast_object_list"}, (rank, ours, counted)
            assert store <= EXTRA_STORE_OPS[ours], (rank, ours, counted)
            # DCP's own collectives all run, each as often as in plain DCP.
            for name, n in counted[theirs].items():
                assert collectives.get(name, 0) >= n, (rank, ours, name)
