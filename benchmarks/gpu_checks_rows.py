"""The rows of gpu_checks.sh's `defaults` part: 1,024 prompts of 100-1,000 words, 128
output tokens each, EOS ignored, as a JSONL file for `gristmill batch`.

    python benchmarks/gpu_checks_rows.py rows.jsonl
"""

import json
import random
import sys

WORDS = "the of and a to in is you that it he was for on are as with his they at be this have from".split()


def main(path: str) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(1024):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(100, 1000)))
            f.write(json.dumps({"prompt": text, "sampling_params": {"max_tokens": 128, "ignore_eos": True}}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
