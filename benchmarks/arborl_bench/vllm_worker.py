"""The vLLM side of ``arborl bench engine``: a persistent worker that runs vLLM's offline ``LLM`` API.

Started once as ``<vllm python> vllm_worker.py`` (vLLM's own interpreter, which need not have arborl:
this file imports only the standard library and the backend), so vLLM's start is paid once and
the bench can alternate arborl and vLLM runs. JSON lines: the first line in is the setup
(``{"backend": "vllm" | "transformers", "model": dir, "max_model_len", "max_num_seqs",
"prefix_caching", "eos_token_ids"}``), answered ``{"ready": true, "startup_s"}``; then requests
``{"op": "generate", "prompts": [[ids]], "max_tokens", "ignore_eos"}`` ->
``{"token_ids": [[ids]], "seconds"}``, ``{"op": "multiturn", "convo": [[ids]], "follow": [turn][session]
[ids], "max_tokens"}`` (each turn extends a session by its completion and that turn's follow-up) ->
``{"token_ids": [[ids]] (last turn), "seconds", "prompt_tokens"}``,
``{"op": "quit"}``. Failures answer ``{"error": message}``. The "transformers" backend (greedy
``generate``, one prompt at a time) exists so the protocol can be tested where vLLM is not installed.
"""

from __future__ import annotations

import json
import os
import sys
import time


class VLLMBackend:
    def __init__(self, setup: dict) -> None:
        from vllm import LLM

        self.llm = LLM(
            model=setup["model"], dtype="float32", max_model_len=setup["max_model_len"],
            max_num_seqs=setup["max_num_seqs"], enable_prefix_caching=setup["prefix_caching"], seed=0,
            skip_tokenizer_init=True, generation_config="vllm",
        )
        self.eos = list(setup["eos_token_ids"])

    def generate(self, prompts: list[list[int]], max_tokens: int, ignore_eos: bool) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, detokenize=False,
                                stop_token_ids=[] if ignore_eos else self.eos)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def reset(self) -> None:
        self.llm.reset_prefix_cache()  # every measured run starts cold, like a fresh arborl engine


class TransformersBackend:
    def __init__(self, setup: dict) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(setup["model"], torch_dtype=torch.float32).eval()
        self.eos = list(setup["eos_token_ids"])

    def generate(self, prompts: list[list[int]], max_tokens: int, ignore_eos: bool) -> list[list[int]]:
        out = []
        with self.torch.inference_mode():
            for p in prompts:
                ids = self.torch.tensor([p])
                gen = self.model.generate(ids, attention_mask=self.torch.ones_like(ids), max_new_tokens=max_tokens,
                                          min_new_tokens=max_tokens if ignore_eos else 0, do_sample=False,
                                          eos_token_id=None if ignore_eos else self.eos, pad_token_id=self.eos[0])
                out.append(gen[0, len(p):].tolist())
        return out

    def reset(self) -> None:
        pass


BACKENDS = {"vllm": VLLMBackend, "transformers": TransformersBackend}


def handle(backend, req: dict) -> dict:
    op = req.get("op")
    backend.reset()
    if op == "generate":
        t0 = time.perf_counter()
        toks = backend.generate(req["prompts"], req["max_tokens"], req["ignore_eos"])
        return {"token_ids": toks, "seconds": time.perf_counter() - t0}
    if op == "multiturn":
        convo = [list(c) for c in req["convo"]]
        prompt_tokens, toks = 0, []
        t0 = time.perf_counter()
        for turn, follow in enumerate(req["follow"] + [None]):
            prompt_tokens += sum(map(len, convo))
            toks = backend.generate(convo, req["max_tokens"], True)
            if follow is not None:
                convo = [c + t + f for c, t, f in zip(convo, toks, follow)]
        return {"token_ids": toks, "seconds": time.perf_counter() - t0, "prompt_tokens": prompt_tokens}
    raise ValueError(f"unknown op {op!r} (generate, multiturn, quit)")


def main() -> None:
    # the protocol owns the real stdout; whatever the backend prints goes to stderr
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    setup = json.loads(sys.stdin.readline())
    t0 = time.perf_counter()
    try:
        backend = BACKENDS[setup.get("backend", "vllm")](setup)
    except Exception as e:  # noqa: BLE001 -- the parent reports why the column is missing
        send({"error": f"{type(e).__name__}: {e}"})
        return
    send({"ready": True, "startup_s": time.perf_counter() - t0})
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("op") == "quit":
            break
        try:
            send(handle(backend, req))
        except Exception as e:  # noqa: BLE001
            send({"error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    main()
