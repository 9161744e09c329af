"""mBART-50 converted from a transformers checkpoint (written by transformers from a small config
with mBART-50's field values, random weights, a SentencePiece model trained here): eager logits,
greedy and beam tokens with the forced target language, tokenizer ids, all against transformers
itself, a negative control and the refusals."""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from hf_checkpoints import sample_lines, write_mbart50  # noqa: E402

from transformer_ext.checkpoint import load_model  # noqa: E402
from transformer_ext.convert import ConversionError, convert_transformers, read_generation_defaults  # noqa: E402
from transformer_ext.decoding import beam_search, greedy_decode  # noqa: E402
from transformer_ext.model import Transformer  # noqa: E402
from transformer_ext.runtimes import EagerRunner  # noqa: E402
from transformer_ext.tokenizer import load_tokenizer  # noqa: E402

T = 40
N_SOURCES = 8


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("mbart")
    hf = write_mbart50(root / "hf", seed=6)
    return hf, convert_transformers(hf, root / "ours")


@functools.lru_cache(maxsize=None)
def _hf_model_at(path: str, dtype=torch.float32):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(path).eval().to(dtype)


def _batch(config, seed: int, lengths=(45, 17, 3, 9)):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    B, S = len(lengths), int(lengths.max())
    ids = torch.randint(4, config.src_vocab_size, (B, S), generator=g)
    mask = torch.arange(S)[None, :] < lengths[:, None]
    ids = ids.masked_fill(~mask, config.pad_id)
    tgt = torch.randint(4, config.tgt_vocab_size, (B, T), generator=g)
    tgt[:, 0] = config.bos_id
    return ids, lengths, mask, tgt


def _reference(hf, ids, mask, tgt, dtype=torch.float32):
    with torch.no_grad():
        return _hf_model_at(str(hf), dtype)(
            input_ids=ids, attention_mask=mask.long(), decoder_input_ids=tgt
        ).logits


def _tol(ref) -> float:
    return 1e-4 * max(1.0, float(np.abs(np.asarray(ref)).max()))


def test_converted_config(folders):
    c = load_model(folders[1]).config
    assert (c.positions, c.pos_offset, c.embedding_norm, c.norm_first, c.activation) == (
        "learned",
        2,
        True,
        True,
        "gelu",
    )
    assert (c.pad_id, c.bos_id, c.eos_id, c.output_bias, c.scale_embeddings) == (1, 2, 2, True, True)
    assert read_generation_defaults(folders[1]).force_target_language


def test_eager_logits_match_transformers(folders):
    hf, ours = folders
    model = load_model(ours)
    ids, lengths, mask, tgt = _batch(model.config, seed=1)
    ref = _reference(hf, ids, mask, tgt).numpy()
    with torch.no_grad():
        teacher = model(ids, lengths, tgt).numpy()
    runner = EagerRunner(model)
    state = runner.encode(ids.numpy(), lengths.numpy(), T, 1)
    steps = np.stack([np.asarray(runner.step(state, tgt[:, t].numpy())) for t in range(T)], axis=1)
    assert np.abs(ref).max() > 1.0
    for what, got in (("teacher forcing", teacher), ("decode steps", steps)):
        diff = np.abs(got - ref)
        assert diff.max() <= _tol(ref), f"{what}: max |diff| {diff.max():.3g}"
    # float64: the same function up to rounding
    with torch.no_grad():
        exact = load_model(ours).double()(ids, lengths, tgt)
    assert (exact - _reference(hf, ids, mask, tgt, torch.float64)).abs().max() < 1e-9


def test_negative_control_position_offset(folders):
    """Positions read from row t instead of t + 2: parity fails."""
    hf, ours = folders
    model = load_model(ours)
    wrong = Transformer(dataclasses.replace(model.config, pos_offset=0))
    state = model.state_dict()
    for key in ("src_pe.table.weight", "tgt_pe.table.weight"):
        state[key] = state[key][: model.config.max_len]  # the same table, read from row t
    wrong.load_state_dict(state)
    wrong.eval()
    ids, lengths, mask, tgt = _batch(model.config, seed=2)
    ref = _reference(hf, ids, mask, tgt).numpy()
    with torch.no_grad():
        got = wrong(ids, lengths, tgt).numpy()
    assert np.abs(got - ref).max() > 100 * _tol(ref)


def _generate(hf, sources, **kwargs):
    S = max(len(s) for s in sources)
    ids = torch.ones((len(sources), S), dtype=torch.int64)
    mask = torch.zeros((len(sources), S), dtype=torch.int64)
    for i, s in enumerate(sources):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    with torch.no_grad():
        out = _hf_model_at(str(hf)).generate(input_ids=ids, attention_mask=mask, **kwargs)
    result = []
    for row in out[:, 1:].tolist():
        row = row[: row.index(2)] if 2 in row else row
        result.append([t for t in row if t != 1])
    return result


@pytest.mark.parametrize("target", ["fr_XX"])
def test_greedy_and_beam_tokens_equal_generate(folders, target):
    hf, ours = folders
    tokenizer = load_tokenizer(ours).with_languages(source_lang="en_XX", target_lang=target)
    defaults = read_generation_defaults(ours)
    sources = [tokenizer.encode_source(line) for line in sample_lines(N_SOURCES, seed=300)]
    S = max(len(s) for s in sources)
    ids = np.ones((N_SOURCES, S), dtype=np.int64)
    for i, s in enumerate(sources):
        ids[i, : len(s)] = s
    lengths = np.array([len(s) for s in sources], dtype=np.int64)
    forced = tokenizer.forced_target_prefix()[0]
    runner = EagerRunner(load_model(ours))
    greedy = _generate(hf, sources, num_beams=1, forced_bos_token_id=forced)
    assert all(g[0] == forced for g in greedy) and len({tuple(g) for g in greedy}) >= N_SOURCES // 2
    got = greedy_decode(runner, ids, lengths, **defaults.search_options(tokenizer, N_SOURCES, beam=False))
    assert [list(g) for g in got] == greedy
    beams = _generate(hf, sources, forced_bos_token_id=forced)
    got = beam_search(runner, ids, lengths, **defaults.search_options(tokenizer, N_SOURCES))
    assert [h[0].tokens for h in got] == beams


def test_tokenizer_ids_equal_transformers(folders):
    """transformers' MBart50Tokenizer, built from the SentencePiece model's pieces and scores (its
    own reading of the file goes through protobuf, which this environment's runtime refuses)."""
    import sentencepiece as spm
    from transformers import MBart50Tokenizer

    hf, ours = folders
    sp = spm.SentencePieceProcessor(model_file=str(hf / "sentencepiece.bpe.model"))
    vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    for src in ("en_XX", "ro_RO"):
        theirs = MBart50Tokenizer(vocab=vocab, src_lang=src, tgt_lang="de_DE")
        ours_tok = load_tokenizer(ours).with_languages(source_lang=src, target_lang="de_DE")
        assert ours_tok.forced_target_prefix() == [theirs.convert_tokens_to_ids("de_DE")]
        for line in sample_lines(200, seed=8):
            ids = theirs(line)["input_ids"]
            assert ours_tok.encode_source(line) == ids, line
            assert ours_tok.decode_target(ids[1:]) == theirs.decode(ids, skip_special_tokens=True), line


def _edited(folders, tmp_path, **tok_cfg):
    dst = tmp_path / "hf"
    shutil.copytree(folders[0], dst)
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return dst


def test_cc25_tokenizer_is_refused_in_one_line(folders, tmp_path):
    hf = _edited(folders, tmp_path, tokenizer_class="MBartTokenizer", src_lang="en_XX")
    with pytest.raises(ConversionError) as info:
        convert_transformers(hf, tmp_path / "out")
    assert 'unsupported tokenizer tokenizer_class = "MBartTokenizer"' in str(info.value)
    assert "\n" not in str(info.value) and not (tmp_path / "out").exists()
