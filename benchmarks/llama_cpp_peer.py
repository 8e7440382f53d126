"""llama.cpp as a benchmark peer, through llama-cpp-python's low-level API: every prompt
of a batch is its own sequence in one context, prefilled together and decoded together
(one `llama_decode` per step for the whole batch), greedy, a fixed number of tokens.

Optional: `pip install -e '.[bench]'` builds llama-cpp-python from source (10-15 min on
2 cores). On CPUs with AMX, build it as `docs/performance.md` says: its native build
crashed in decode on one such machine.
"""

from __future__ import annotations

import ctypes
import os
import time

import numpy as np


class LlamaCppPeer:
    def __init__(self, gguf_path: str, max_tokens_in_context: int, max_seqs: int):
        import llama_cpp

        self.lib = llama_cpp
        llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p())
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(gguf_path.encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = max_tokens_in_context
        params.n_batch = params.n_ubatch = 512
        params.n_seq_max = max_seqs
        params.n_threads = params.n_threads_batch = os.cpu_count()
        params.kv_unified = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context (n_ctx too large?)")
        self.batch = llama_cpp.llama_batch_init(512, 0, max_seqs)
        self.threads = params.n_threads

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        out = (self.lib.llama_token * (len(data) + 8))()
        n = self.lib.llama_tokenize(self.vocab, data, len(data), out, len(out), True, False)
        return list(out[:n])

    def generate(self, prompts: list[str], output_len: int, shared_prefix: int = 0) -> tuple[float, list[list[int]]]:
        """Greedy-generate `output_len` tokens for each prompt; (tok/s, tokens).

        `shared_prefix`: the prompts' first tokens are equal up to there; they are decoded
        once, their KV cells belonging to every sequence (llama.cpp's own way to share a
        prompt, as its batched example does), and each prompt computes only the rest."""
        lib = self.lib
        lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        seqs = [self.tokenize(p) for p in prompts]
        every = tuple(range(len(seqs)))
        # Prefill: the shared tokens once, then every prompt's own, in batches of up to
        # 512, logits for each last token.
        pending = [(every, pos, tok, False) for pos, tok in enumerate(seqs[0][:shared_prefix])]
        pending += [((s,), pos, tok, pos == len(ids) - 1) for s, ids in enumerate(seqs)
                    for pos, tok in enumerate(ids) if pos >= shared_prefix]
        last_logits = {}
        for i in range(0, len(pending), 512):
            chunk = pending[i:i + 512]
            self._decode(chunk)
            for row, (s, _, _, wants) in enumerate(chunk):
                if wants:
                    last_logits[s[0]] = self._argmax(row)
        outputs = [[last_logits[s]] for s in range(len(seqs))]
        for step in range(1, output_len):
            chunk = [((s,), len(seqs[s]) + step - 1, outputs[s][-1], True) for s in range(len(seqs))]
            self._decode(chunk)
            for row, (s, _, _, _) in enumerate(chunk):
                outputs[s[0]].append(self._argmax(row))
        elapsed = time.perf_counter() - start
        return len(prompts) * output_len / elapsed, outputs

    def _decode(self, chunk: list[tuple[tuple[int, ...], int, int, bool]]) -> None:
        b = self.batch
        b.n_tokens = len(chunk)
        for row, (seq_ids, pos, tok, wants) in enumerate(chunk):
            b.token[row], b.pos[row], b.n_seq_id[row], b.logits[row] = tok, pos, len(seq_ids), wants
            for j, s in enumerate(seq_ids):
                b.seq_id[row][j] = s
        code = self.lib.llama_decode(self.ctx, b)
        if code != 0:
            raise RuntimeError(f"llama_decode failed ({code}): raise n_ctx")

    def _argmax(self, row: int) -> int:
        ptr = self.lib.llama_get_logits_ith(self.ctx, row)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


def system_info() -> str:
    import llama_cpp
    return llama_cpp.llama_print_system_info().decode()


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _QUIET(level, text, user_data):  # keep llama.cpp's load log off the benchmark table
    return None
