"""cairn.export_safetensors: sharded Hugging Face folders, from one process and from two in parallel.

The exported folder is read back by `safetensors` and by `transformers`'
`from_pretrained`, and must give the very tensors of the model that was
saved (a tiny Llama built from a config, random weights, no download).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import cairn
from _mp import run
from cairn._exports.export import assign, pack, parse_size

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256)


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    """(hf folder, cairn checkpoint of it under "params", the model's state dict)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    base = tmp_path_factory.mktemp("export")
    model.save_pretrained(base / "hf", max_shard_size="100KB")
    ckpt = base / "ck"
    cairn.save(ckpt, {"params": cairn.load(base / "hf"), "step": 3, "note": "from hf"})
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return base / "hf", ckpt, sd


def check_folder(dst, hf, sd):
    from safetensors.numpy import load_file

    index = json.loads((dst / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == sorted(n for n in os.listdir(dst) if n.endswith(".safetensors"))
    assert set(index["weight_map"]) == set(sd)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in sd.values())
    for f in files:
        got = load_file(str(dst / f))
        for name, a in got.items():
            assert index["weight_map"][name] == f
            np.testing.assert_array_equal(a, sd[name].numpy(), err_msg=name)
    shutil.copy(hf / "config.json", dst / "config.json")
    model = transformers.LlamaForCausalLM.from_pretrained(dst)
    for name, t in model.state_dict().items():
        assert torch.equal(t, sd[name]), name


def test_export_one_process_reads_back_with_safetensors_and_transformers(llama_ckpt, tmp_path):
    hf, ckpt, sd = llama_ckpt
    files = cairn.export_safetensors(ckpt, tmp_path / "out", max_shard_size="100KB", item="params")
    assert files[-1].endswith("model.safetensors.index.json") and len(files) > 3
    check_folder(tmp_path / "out", hf, sd)
    # HF's own packing rule: no file over the limit unless it holds one tensor
    for f in files[:-1]:
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        header.pop("__metadata__")
        data = sum(t["data_offsets"][1] - t["data_offsets"][0] for t in header.values())
        assert data <= 100_000 or len(header) == 1, (f, data)
    with pytest.raises(cairn.CheckpointExistsError, match="overwrite=True"):
        cairn.export_safetensors(ckpt, tmp_path / "out", max_shard_size="100KB", item="params")
    # overwrite with one big file: the old shards and index go
    files = cairn.export_safetensors(ckpt, tmp_path / "out", max_shard_size="1GB", item="params", overwrite=True)
    assert [os.path.basename(f) for f in files] == ["model.safetensors"]
    assert sorted(n for n in os.listdir(tmp_path / "out") if "safetensors" in n) == ["model.safetensors"]
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(model.state_dict()["lm_head.weight"], sd["lm_head.weight"])


def test_export_names_rename_and_values(tmp_path, llama_ckpt):
    from safetensors.numpy import load_file

    _hf, ckpt, sd = llama_ckpt
    # Without item: "params" is the only checkpointable with arrays, so HF's names come out bare;
    # values ("step", "note") are left out. names="raw": cairn's key paths, checkpointable first.
    cairn.export_safetensors(ckpt, tmp_path / "all", max_shard_size="10MB")
    got = load_file(str(tmp_path / "all" / "model.safetensors"))
    assert set(got) == set(sd)
    cairn.export_safetensors(ckpt, tmp_path / "raw", max_shard_size="10MB", names="raw")
    got = load_file(str(tmp_path / "raw" / "model.safetensors"))
    assert set(got) == {"params/" + k.replace(".", "/") for k in sd}
    cairn.export_safetensors(ckpt, tmp_path / "renamed", item="params",
                             rename=[(r"^model/layers/(\d+)/", r"blocks/\1/"), (r"^lm_head/", None)])
    got = load_file(str(tmp_path / "renamed" / "model.safetensors"))
    assert "blocks.1.mlp.up_proj.weight" in got and not any(k.startswith("lm_head") for k in got)
    with pytest.raises(cairn.CheckpointError, match="both become tensor 'x'"):
        cairn.export_safetensors(ckpt, tmp_path / "clash", item="params", rename=lambda p: "x")
    with pytest.raises(cairn.CheckpointError, match="no checkpointable 'nope'"):
        cairn.export_safetensors(ckpt, tmp_path / "x", item="nope")


def test_cli_convert_to_sharded_safetensors(llama_ckpt, tmp_path, capsys):
    from cairn._cli.main import main

    hf, _ckpt, sd = llama_ckpt
    cairn.save(tmp_path / "flat", cairn.load(hf))  # the HF tree at the root: names come out as HF's
    assert main(["-q", "convert", str(tmp_path / "flat"), str(tmp_path / "out"), "--to", "safetensors",
                 "--max-shard-size", "100KB", "--all-items"]) == 0  # "model" and "lm_head": HF's own names
    assert "model.safetensors.index.json" in capsys.readouterr().out
    check_folder(tmp_path / "out", hf, sd)


def test_packing_and_assignment_are_deterministic():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 << 30 and parse_size(1000) == 1000
    assert parse_size("100KB") == 100_000
    with pytest.raises(ValueError):
        parse_size("lots")
    assert pack([5, 5, 5, 20, 1], 10) == [[0, 1], [2], [3], [4]]
    sizes = [40, 10, 30, 20, 20]
    assert assign(sizes, 2) == assign(sizes, 2) == [0, 1, 1, 1, 0]  # loads 60 / 60
    assert assign(sizes, 8)[:5] == [0, 4, 1, 2, 3]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_export_from_two_processes(llama_ckpt, tmp_path):
    hf, ckpt, sd = llama_ckpt
    dst = tmp_path / "mp"
    results = run(2, "export_scenarios:export",
                  {"ckpt": str(ckpt), "dst": str(dst), "max_shard_size": "60KB", "item": "params"}, timeout=200)
    shards = sorted(n for n in os.listdir(dst) if n.endswith(".safetensors"))
    assert len(shards) >= 4
    written = [set(r["written"]) for r in results]
    # Every process wrote whole files, none twice, all of them between the two; the index is not among
    # them (process 0 puts it, last, after both reported done).
    assert written[0] and written[1] and not written[0] & written[1]
    assert written[0] | written[1] == set(shards)
    assert results[0]["files"] == results[1]["files"] == [*shards, "model.safetensors.index.json"]
    index_mtime = os.path.getmtime(dst / "model.safetensors.index.json")
    assert all(os.path.getmtime(dst / s) <= index_mtime for s in shards)
    check_folder(dst, hf, sd)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_processes_load_a_hugging_face_folder(llama_ckpt):
    hf, _ckpt, _sd = llama_ckpt
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight",
             "model.layers.1.mlp.down_proj.weight"]
    results = run(2, "export_scenarios:load_hf", {"path": str(hf), "names": names}, timeout=200)
    assert [r["checked"] for r in results] == [4, 4]


GPT2 = dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=128)


def test_gpt2_converted_by_the_cli_loads_in_transformers_with_no_missing_keys(tmp_path, capsys):
    """`cairn convert CKPT model.safetensors --to safetensors` writes HF's names by default."""
    import jax

    from cairn._cli.main import main

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
    model.save_pretrained(tmp_path / "hf")
    tree = cairn.load(tmp_path / "hf")
    assert "transformer" in tree and "h" in tree["transformer"]
    cairn.save(tmp_path / "ck", {"params": tree, "step": 3, "rng": jax.random.key(0)})
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def loads(folder):
        shutil.copy(tmp_path / "hf" / "config.json", folder / "config.json")
        got, info = transformers.GPT2LMHeadModel.from_pretrained(folder, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
        for name, t in got.state_dict().items():
            assert torch.equal(t, want[name]), name

    # Only "params" holds tensors: its HF names come out bare. With the key beside it, --item picks it.
    cairn.save(tmp_path / "ck1", {"params": tree, "step": 3})
    (tmp_path / "one").mkdir()
    assert main(["-q", "convert", str(tmp_path / "ck1"), str(tmp_path / "one" / "model.safetensors"),
                 "--to", "safetensors"]) == 0
    loads(tmp_path / "one")
    (tmp_path / "two").mkdir()
    assert main(["-q", "convert", str(tmp_path / "ck"), str(tmp_path / "two" / "model.safetensors"),
                 "--to", "safetensors", "--item", "params"]) == 0
    loads(tmp_path / "two")
    # The sharded export: a typed PRNG key is refused by name, unless asked for.
    capsys.readouterr()
    assert main(["-q", "convert", str(tmp_path / "ck"), str(tmp_path / "sharded"), "--to", "safetensors",
                 "--max-shard-size", "50KB"]) == 1
    assert "'rng' is a typed PRNG key" in capsys.readouterr().err
    assert main(["-q", "convert", str(tmp_path / "ck"), str(tmp_path / "sharded"), "--to", "safetensors",
                 "--max-shard-size", "50KB", "--prng-keys", "drop"]) == 0
    loads(tmp_path / "sharded")
    files = cairn.export_safetensors(tmp_path / "ck", tmp_path / "keys", prng_keys="data", names="raw")
    from safetensors import safe_open

    with safe_open(files[0], "np") as f:
        assert json.loads(f.metadata()["cairn.prng_keys"]) == {"rng": "threefry2x32"}
        np.testing.assert_array_equal(f.get_tensor("rng"), np.asarray(jax.random.key_data(jax.random.key(0))))
        assert "params/transformer/h/0/attn/c_attn/weight" in list(f.keys())
