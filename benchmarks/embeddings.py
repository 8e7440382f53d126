"""Embedding throughput and quality, peers side by side in one run: all-MiniLM-L6-v2 over
2,000 sentences of 10-120 tokens (cut deterministically from tests/data/public_domain_english.txt)
by

- sentence-transformers (torch, float32): `SentenceTransformer(path).encode(batch_size=32)`,
- ONNX Runtime: the same model exported to ONNX here (torch.onnx.export, as
  sentence-transformers' backend="onnx" does), batches sorted by length as
  sentence-transformers sorts them, mean pooling and normalization in numpy,
- gristmill `LLM(task="embed")` with quantization "int8" and None (float32).

Prints sentences/s and tokens/s of each (the best of `--runs` rounds, peers interleaved
within a round), the ratios to sentence-transformers, and quality against
sentence-transformers' float vectors: the min and mean cosine of each sentence's vector,
and search: for 100 query sentences, how many of the top-10 neighbours among the corpus
(by cosine) are sentence-transformers' top-10, in percent.

    python benchmarks/embeddings.py                    # 2,000 sentences, all peers
    python benchmarks/embeddings.py --sentences 300 --peers st,float
    python benchmarks/embeddings.py --device cuda      # ORT only with its CUDA provider

The ONNX export needs the onnx package (pip install -e '.[bench]').
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if "PYTHONPATH" not in os.environ:  # this checkout's gristmill, not the one installed
    sys.path.insert(0, str(ROOT))
TEXT = ROOT / "tests" / "data" / "public_domain_english.txt"
PEERS = ("st", "ort", "int8", "float")
NAMES = {"st": "sentence-transformers", "ort": "onnxruntime", "int8": "gristmill int8", "float": "gristmill float32"}


def make_sentences(tokenizer, count: int, min_tokens: int, max_tokens: int, seed: int) -> list[str]:
    """`count` pieces of the public-domain text, each cut at word boundaries to about a
    length drawn uniformly from [min_tokens, max_tokens] (wordpiece tokens, before [CLS]
    and [SEP]), starting at a place drawn from the text (read as a loop)."""
    words = TEXT.read_text().split()
    tokens_per_word = np.array([len(tokenizer.encode(w, add_special_tokens=False)) for w in words])
    rng = np.random.default_rng(seed)
    sentences = []
    for _ in range(count):
        target, start = rng.integers(min_tokens, max_tokens + 1), rng.integers(len(words))
        taken, total = [], 0
        while total < target:
            i = (start + len(taken)) % len(words)
            taken.append(words[i])
            total += tokens_per_word[i]
        sentences.append(" ".join(taken))
    return sentences


def cpu_flags() -> str:
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8")
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    return " ".join(f for f in wanted if f in flags) or "none of " + ",".join(wanted)


# -- peers: each returns the (n, 384) float32 normalized embeddings of its sentences ------

class SentenceTransformersPeer:
    def __init__(self, model_dir: str, device: str, batch_size: int):
        from sentence_transformers import SentenceTransformer
        self.model = SentenceTransformer(model_dir, device=device)
        self.batch_size = batch_size

    def embed(self, sentences: list[str]) -> np.ndarray:
        return self.model.encode(sentences, batch_size=self.batch_size, convert_to_numpy=True)


class OnnxRuntimePeer:
    """The model's transformer exported to ONNX (last hidden state), then what
    sentence-transformers does around it: sort by length, tokenize a batch padded to its
    longest, mean-pool over the attention mask, normalize."""

    def __init__(self, model_dir: str, device: str, batch_size: int, threads: int, workdir: str):
        import onnxruntime as ort
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.batch_size = batch_size
        path = Path(workdir) / "model.onnx"
        _export_onnx(AutoModel.from_pretrained(model_dir, attn_implementation="eager").eval(), path)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        providers = ["CUDAExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(str(path), options, providers=providers)

    def embed(self, sentences: list[str]) -> np.ndarray:
        order = np.argsort([-len(s) for s in sentences], kind="stable")  # longest first, as ST
        out = None
        for i in range(0, len(order), self.batch_size):
            rows = order[i:i + self.batch_size]
            batch = self.tokenizer([sentences[j] for j in rows], padding=True, truncation=True,
                                   max_length=256, return_tensors="np")
            hidden = self.session.run(None, {k: batch[k].astype(np.int64) for k in
                                             ("input_ids", "attention_mask", "token_type_ids")})[0]
            mask = batch["attention_mask"][:, :, None].astype(np.float32)
            pooled = (hidden * mask).sum(1) / np.maximum(mask.sum(1), 1e-9)
            if out is None:
                out = np.empty((len(sentences), pooled.shape[1]), dtype=np.float32)
            out[rows] = pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return out


def _export_onnx(model, path: Path) -> None:
    class LastHiddenState(torch.nn.Module):  # positional inputs, one output: what ORT runs
        def __init__(self, bert):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask,
                             token_type_ids=token_type_ids).last_hidden_state

    ids = torch.ones(2, 8, dtype=torch.long)
    names = ["input_ids", "attention_mask", "token_type_ids"]
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(LastHiddenState(model), (ids, ids, torch.zeros_like(ids)), str(path),
                          input_names=names, output_names=["last_hidden_state"], opset_version=17,
                          dynamic_axes={n: {0: "batch", 1: "sequence"} for n in [*names, "last_hidden_state"]},
                          dynamo=False)


class GristmillPeer:
    def __init__(self, device: str, quantization: str | None):
        from gristmill import LLM
        self.llm = LLM(task="embed", device=device, quantization=quantization)

    def embed(self, sentences: list[str]) -> np.ndarray:
        outs = self.llm.embed(sentences, use_tqdm=False)
        return np.asarray([o.outputs.embedding for o in outs], dtype=np.float32)


# -- quality ---------------------------------------------------------------------------

def cosines(ours: np.ndarray, reference: np.ndarray) -> np.ndarray:
    dots = (ours * reference).sum(1)
    return dots / (np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1))


def top10_overlap(queries: np.ndarray, corpus: np.ndarray, ref_queries: np.ndarray, ref_corpus: np.ndarray) -> float:
    """Percent of the reference's top-10 corpus neighbours of each query that are ours too."""
    def top10(q, c):
        return np.argsort(-(q @ c.T), axis=1)[:, :10]

    ours, theirs = top10(queries, corpus), top10(ref_queries, ref_corpus)
    return 100 * np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ours, theirs)])


def measure(peers: dict, sentences: list[str], chunk: int, runs: int) -> tuple[dict, dict]:
    """({peer: seconds}, {peer: vectors}) over `sentences`: each chunk embedded `runs`
    times by every peer, peers taking turns (in a rotating order), its best time kept.
    Short turns and the best of each: on a machine others load in bursts, a burst costs
    one turn of one peer, not a peer's whole figure."""
    seconds = dict.fromkeys(peers, 0.0)
    parts = {name: [] for name in peers}
    names = list(peers)
    for turn, start in enumerate(range(0, len(sentences), chunk)):
        best, last = dict.fromkeys(peers, float("inf")), {}
        for run in range(runs):
            shift = (turn * runs + run) % len(names)
            for name in names[shift:] + names[:shift]:
                started = time.perf_counter()
                last[name] = peers[name].embed(sentences[start:start + chunk])
                best[name] = min(best[name], time.perf_counter() - started)
        for name in peers:
            seconds[name] += best[name]
            parts[name].append(last[name])
    return seconds, {name: np.concatenate(chunks) for name, chunks in parts.items()}


def versions() -> str:
    import onnxruntime
    import sentence_transformers
    import transformers

    import gristmill
    tree = Path(gristmill.__file__).parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=tree).stdout.strip() or "?"
    except OSError:
        commit = "?"
    return (f"torch {torch.__version__}, sentence-transformers {sentence_transformers.__version__}, onnxruntime "
            f"{onnxruntime.__version__}, transformers {transformers.__version__}, gristmill {commit} ({tree}), "
            f"python {platform.python_version()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sentences", type=int, default=2000)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--peers", default=",".join(PEERS), help=f"which to run, of {','.join(PEERS)}")
    parser.add_argument("--runs", type=int, default=2, help="times each chunk is embedded by each peer")
    parser.add_argument("--chunk", type=int, default=250, help="sentences a timed call embeds")
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' and ORT's batch")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (gristmill int8 is CPU only)")
    args = parser.parse_args()
    peers = args.peers.split(",")
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        parser.error(f"unknown peers {unknown}: --peers takes {','.join(PEERS)}")
    if args.device.startswith("cuda"):
        peers = [p for p in peers if p != "int8"]

    from gristmill.paths import default_embedding_model_path
    from transformers import AutoTokenizer

    model_dir = str(default_embedding_model_path())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sentences = make_sentences(tokenizer, args.sentences, 10, 120, seed=0)
    queries = make_sentences(tokenizer, args.queries, 8, 40, seed=1)
    num_tokens = sum(len(ids) for ids in tokenizer(sentences)["input_ids"])  # [CLS] and [SEP] included
    print(f"cpu flags: {cpu_flags()}; {torch.get_num_threads()} torch threads; device {args.device}")
    print(versions())
    print(f"{len(sentences)} sentences, {num_tokens} tokens ({num_tokens / len(sentences):.1f} a sentence, "
          f"[CLS]/[SEP] included); {len(queries)} queries")

    workdir = tempfile.TemporaryDirectory()
    built = {}
    for name in peers:
        started = time.perf_counter()
        if name == "st":
            built[name] = SentenceTransformersPeer(model_dir, args.device, args.batch_size)
        elif name == "ort":
            try:
                import onnxruntime
                if args.device.startswith("cuda") and "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
                    print("onnxruntime: skipped (no CUDAExecutionProvider)")
                    continue
                built[name] = OnnxRuntimePeer(model_dir, args.device, args.batch_size, torch.get_num_threads(),
                                              workdir.name)
            except ImportError as exc:
                print(f"onnxruntime: skipped ({exc}; pip install -e '.[bench]' installs onnx)")
                continue
        else:
            built[name] = GristmillPeer(args.device, "int8" if name == "int8" else None)
        built[name].embed(sentences[:64])  # warm up
        print(f"{NAMES[name]}: ready in {time.perf_counter() - started:.1f} s")

    seconds, vectors = measure(built, sentences, args.chunk, args.runs)
    query_vectors = {name: peer.embed(queries) for name, peer in built.items()}

    print(f"\n{'peer':<22}{'sent/s':>9}{'tok/s':>9}{'x ST':>7}{'min cos':>11}{'mean cos':>11}{'top-10':>8}")
    for name in built:
        line = f"{NAMES[name]:<22}{len(sentences) / seconds[name]:>9.1f}{num_tokens / seconds[name]:>9.0f}"
        if "st" in built:
            line += f"{seconds['st'] / seconds[name]:>7.2f}"
            cos = cosines(vectors[name], vectors["st"])
            overlap = top10_overlap(query_vectors[name], vectors[name], query_vectors["st"], vectors["st"])
            line += f"{cos.min():>11.7f}{cos.mean():>11.7f}{overlap:>7.1f}%"
        print(line)
    print(f"(each chunk of {args.chunk} sentences timed {args.runs} times per peer, peers interleaved, the best "
          f"kept; quality against sentence-transformers float32)")


if __name__ == "__main__":
    main()
