"""Chat turns at the token level, so a conversation's next turn re-sends the exact ids the
model produced and its answer's blocks hit the prefix cache."""

from __future__ import annotations

from harness.model.tokenizer import Tokenizer


def next_turn_ids(tok: Tokenizer, messages: list[dict[str, str]], prev_prompt: list[int],
                  answer_ids: list[int], user: str) -> list[int]:
    """Ids of the prompt that follows ``prev_prompt`` + the model's ``answer_ids``.

    ``messages`` is the history that produced ``prev_prompt`` (ending with a user turn).
    The template's text for the next prompt must begin with the text of the previous
    prompt followed by the answer; the ids are then ``prev_prompt + answer_ids + tail``,
    where only the template's closing of the answer and the new user turn are encoded.
    Templates that rewrite history (strip, reorder) fall back to a full re-encoding, as a
    chat server re-tokenizing the history would do.
    """
    eos = set(tok.eos_ids)
    content_ids = [t for t in answer_ids if t not in eos]
    answer = tok.decode(content_ids)
    pre = tok.render_chat(messages, add_generation_prompt=True)
    history = [*messages, {"role": "assistant", "content": answer}, {"role": "user",
                                                                        "content": user}]
    full = tok.render_chat(history, add_generation_prompt=True)
    if not full.startswith(pre + answer):
        return tok.apply_chat_template(history)
    tail = full[len(pre) + len(answer):]
    ended = bool(answer_ids) and answer_ids[-1] in eos
    if ended:
        eos_text = tok.token_text(answer_ids[-1])
        if not tail.startswith(eos_text):
            return tok.apply_chat_template(history)
        tail = tail[len(eos_text):]
    return prev_prompt + list(answer_ids) + tok.encode(tail, add_bos=False)
