"""What the vLLM prefill engine cannot prefill, told before a worker sees it (the API answers
400): vLLM itself needs no install for this check."""

from oasiskv.models.sampling import SamplingParams
from oasiskv.prefill_node.vllm_worker import vllm_prefill_refusal

SEEDED = SamplingParams(temperature=0.8, seed=7)


def test_a_seeded_sampled_prompt_longer_than_one_vllm_step_is_refused_on_cpus():
    # One step is the chunk, 256 at least: vLLM rewinds a seeded generator after a partial
    # prefill, which a CPU generator cannot do; the failure then wedged the worker.
    assert "cannot be prefilled by vLLM on CPUs" in vllm_prefill_refusal(1025, SEEDED, 1024, None, "cpu")
    assert "over 256 tokens" in vllm_prefill_refusal(300, SEEDED, 16, None, "cpu")
    assert vllm_prefill_refusal(1024, SEEDED, 1024, None, "cpu") is None  # one step
    assert vllm_prefill_refusal(5000, SEEDED, 1024, None, "cuda") is None
    assert vllm_prefill_refusal(5000, SamplingParams(temperature=0.8), 1024, None, "cpu") is None  # no seed
    assert vllm_prefill_refusal(5000, SamplingParams(temperature=0.0, seed=7), 1024, None, "cpu") is None  # greedy


def test_a_prompt_vllms_max_model_len_cannot_hold_is_refused():
    greedy = SamplingParams()
    message = vllm_prefill_refusal(2048, greedy, 1024, 2048, "cpu")
    assert "--vllm-max-model-len" in message and "up to 2047 tokens" in message
    assert vllm_prefill_refusal(2047, greedy, 1024, 2048, "cpu") is None
    assert vllm_prefill_refusal(100_000, greedy, 1024, None, "cpu") is None  # the model's own context is checked apart
