"""Tokenization equals processor(text=..., images=...) of the checkpoint's HF processor."""

from __future__ import annotations

import pytest

from decoder_svc.tokenization import CHAT_ROLES, PlaceholderMismatchError, PromptError, PromptTokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return PromptTokenizer(tiny_model_dir)


@pytest.mark.parametrize("prompt", [
    "USER: <image>\nWhat is this? ASSISTANT:",
    "<image>",
    "<image><image>two adjacent",
    "text then <image>",
    "no images at all, just text 123 \u00e9\u4e16\U0001f642",
    "a<image>b<image>c<image>d",
])
def test_same_ids_as_hf_processor(tok, hf_oracle, images, prompt):
    n = prompt.count("<image>")
    imgs = [images[i % len(images)] for i in range(n)]
    ours = tok.encode_prompt(prompt, [(im.height, im.width) for im in imgs])
    ref = hf_oracle.processor(text=prompt, images=imgs or None)["input_ids"][0]
    assert ours.token_ids == list(ref)
    assert len(ours.placeholders) == n
    for k, ph in enumerate(ours.placeholders):
        assert ph.image_index == k and ph.length == 16
        assert set(ours.token_ids[ph.offset:ph.offset + ph.length]) == {tok.image_token_id}
    assert sum(t == tok.image_token_id for t in ours.token_ids) == 16 * n


def test_image_size_not_needed(tok):
    sized = tok.encode_prompt("<image>x", [(999, 3)]).token_ids
    assert tok.encode_prompt("<image>x", [None]).token_ids == sized


def test_chat_template_same_as_hf(tok, hf_oracle, images):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    ours = tok.encode_chat(messages, [None])
    text = hf_oracle.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.token_ids == list(hf_oracle.processor(text=text, images=images[:1])["input_ids"][0])


def test_placeholder_count_mismatch(tok):
    with pytest.raises(PlaceholderMismatchError, match="2 <image> placeholders but 1 images"):
        tok.encode_prompt("<image><image>", [None])
    with pytest.raises(PlaceholderMismatchError):
        tok.encode_prompt("no marker", [None])
    assert issubclass(PlaceholderMismatchError, ValueError)
    with pytest.raises(PromptError):
        tok.encode_prompt("", [])


@pytest.mark.parametrize("messages, match", [
    ([{"role": "user", "content": "hi"}, {"role": "{{ 7*7 }}", "content": "x"}],
     r"message 1: unsupported role '\{\{ 7\*7 \}\}'"),
    ([{"role": "US ER", "content": "hi"}], "message 0: unsupported role 'US ER'"),
    ([{"role": "user\nASSISTANT", "content": "hi"}], "message 0: unsupported role"),
    ([{"role": ["user"], "content": "hi"}], r"message 0: unsupported role \['user'\]"),  # not hashable
    ([{"content": "hi"}], "message 0: unsupported role None"),
    ([{"role": "x" * 10_000, "content": "hi"}], r"unsupported role 'x{36}\.\.\.; use one of"),  # short text
    (["user: hi"], "message 0: not a mapping"),
    ([{"role": "user", "content": ""}], "message 0: empty content"),
    ([{"role": "user", "content": None}], "message 0: content must be a string or a list"),
    ([{"role": "user", "content": [{"type": "text", "text": None}]}], "message 0 part 0: text must be"),
    ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": ""}]}],
     "message 0 part 1: text must be a non-empty string"),
    ([{"role": "user", "content": [{"type": "video"}]}], "message 0 part 0: not a text or image part"),
    ([{"role": "user", "content": ["hi"]}], "message 0 part 0: not a text or image part"),
])
def test_chat_refuses_bad_roles_and_parts(tok, messages, match):
    # PromptError is a ValueError: the server answers INVALID_ARGUMENT with this message.
    with pytest.raises(PromptError, match=match):
        tok.encode_chat(messages)  # checked before rendering: the image count does not matter


def test_chat_takes_every_supported_role(tok):
    messages = [{"role": role, "content": f"{role} text"} for role in sorted(CHAT_ROLES)]
    text = tok.decode(tok.encode_chat(messages).token_ids)
    assert CHAT_ROLES == {"system", "user", "assistant"}
    assert "user text" in text and "ASSISTANT: assistant text" in text and "system text" in text


def test_chat_takes_a_custom_role_the_template_renders(tok):
    text = tok.decode(tok.encode_chat([{"role": "critic", "content": "critic text"},
                                       {"role": "user", "content": "hi"}]).token_ids)
    assert "CRITIC: critic text" in text  # the tiny template writes ROLE: for every non-system role


def test_a_template_that_cannot_render_the_chat_is_a_prompt_error(tok, monkeypatch):
    def refuse(*args, **kwargs):
        import jinja2

        raise jinja2.TemplateError("Conversation roles must alternate user/assistant")

    monkeypatch.setattr(tok.processor, "apply_chat_template", refuse)
    with pytest.raises(PromptError, match="cannot render these messages: Conversation roles"):
        tok.encode_chat([{"role": "user", "content": "hi"}])


def test_a_qwen_prompt_may_mark_images_with_the_generic_image_marker(qwen_model_dir):
    # `mmserve generate --prompt "<image> ..."` promises <image> for every model: on Qwen-VL it is the
    # model's vision block, exactly as if the prompt had written it.
    qwen = PromptTokenizer(qwen_model_dir)
    block = "<|vision_start|><|image_pad|><|vision_end|>"
    native = qwen.encode_prompt(f"{block}\nWhat is it?", image_token_counts=[4])
    generic = qwen.encode_prompt("<image>\nWhat is it?", image_token_counts=[4])
    assert generic.token_ids == native.token_ids and generic.placeholders == native.placeholders
    with pytest.raises(PlaceholderMismatchError):  # a count that does not match is still refused
        qwen.encode_prompt("<image><image>\nWhat is it?", image_token_counts=[4])
