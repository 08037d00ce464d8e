"""The episode and reward of examples/arith_refine.yaml: each attempt answers, reads the question
again after its answer, and answers a second time; the attempt is trained on as one sample (the
repeated question with loss mask 0) and rewarded for its second answer."""

import asyncio


async def refine(gen, prompt, params):
    """``params.n`` attempts at ``prompt``, at once: draft, the question again, final answer."""
    question = gen.tokenizer.encode(" " + prompt.metadata["prompt"].text, add_special_tokens=False)

    async def attempt():
        draft = await gen.generate(prompt.prompt_ids)
        final = await gen.generate(draft.prompt_ids + draft.response_ids + question)
        return gen.join(draft, question, final)

    return await asyncio.gather(*(attempt() for _ in range(params.n)))


def second_answer(prompt, response):
    """1 when the answer after the repeated question is the sum, else 0."""
    return float(response.rsplit("=", 1)[-1].strip() == prompt.answer)
