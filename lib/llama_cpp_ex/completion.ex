defmodule LlamaCppEx.Completion do
  @moduledoc false
  # OpenAI-shaped results (`LlamaCppEx.ChatCompletion`, `LlamaCppEx.ChatCompletionChunk`)
  # built from a request's events, the same for both routes.

  alias LlamaCppEx.{ChatCompletion, ChatCompletionChunk, Generation, Model, Thinking}

  @doc """
  A whole completion of the prepared request `gen` from `Source.collect/1`'s result
  (`:enable_thinking` in `opts` splits `<think>` blocks).
  """
  @spec completion(Generation.t(), map(), keyword()) :: ChatCompletion.t()
  def completion(%Generation{} = gen, %{text: text, reason: reason} = r, opts) do
    {model, n_prompt, n} = {gen.model, length(gen.tokens), r.completion_tokens}
    {reasoning, content} = if opts[:enable_thinking], do: Thinking.parse(text), else: {"", text}

    choice = %{
      index: 0,
      message: %{
        role: "assistant",
        content: content,
        reasoning_content: if(reasoning == "", do: nil, else: reasoning)
      },
      finish_reason: finish_reason(reason)
    }

    choice =
      if gen.logprobs,
        do: Map.put(choice, :logprobs, %{content: Enum.map(r.logprobs, &openai_logprob/1)}),
        else: choice

    %ChatCompletion{
      id: id(),
      object: "chat.completion",
      created: System.os_time(:second),
      model: Model.desc(model),
      choices: [choice],
      usage: %{prompt_tokens: n_prompt, completion_tokens: n, total_tokens: n_prompt + n}
    }
  end

  @doc "`eog`/`stop` → \"stop\", `max_tokens` → \"length\"."
  @spec finish_reason(atom()) :: String.t()
  def finish_reason(reason) when reason in [:eog, :stop], do: "stop"
  def finish_reason(_), do: "length"

  @doc "A chunk stream's shared fields."
  @spec chunk_base(Model.t()) :: ChatCompletionChunk.t()
  def chunk_base(model) do
    %ChatCompletionChunk{
      id: id(),
      object: "chat.completion.chunk",
      created: System.os_time(:second),
      model: Model.desc(model)
    }
  end

  @doc "One chunk with `delta` (and `finish_reason`)."
  @spec chunk(ChatCompletionChunk.t(), map(), String.t() | nil) :: ChatCompletionChunk.t()
  def chunk(base, delta, finish),
    do: %{base | choices: [%{index: 0, delta: delta, finish_reason: finish}]}

  @doc "A chunk carrying log-probabilities on its choice."
  @spec with_logprobs(ChatCompletionChunk.t(), [term()]) :: ChatCompletionChunk.t()
  def with_logprobs(%{choices: [choice]} = chunk, lps),
    do: %{
      chunk
      | choices: [Map.put(choice, :logprobs, %{content: Enum.map(lps, &openai_logprob/1)})]
    }

  @doc "One token's log-probabilities in OpenAI's shape."
  @spec openai_logprob({binary(), {float(), [{integer(), binary(), float()}]}}) :: map()
  def openai_logprob({piece, {lp, top}}) do
    %{
      token: printable(piece),
      logprob: lp,
      bytes: :binary.bin_to_list(piece),
      top_logprobs:
        Enum.map(top, fn {_id, p, l} ->
          %{token: printable(p), logprob: l, bytes: :binary.bin_to_list(p)}
        end)
    }
  end

  # A token's text; bytes that are not valid UTF-8 on their own (a codepoint split across
  # tokens) become U+FFFD, as OpenAI's API does; `bytes` keeps them exact.
  defp printable(piece) do
    case :unicode.characters_to_binary(piece) do
      s when is_binary(s) -> s
      {_, good, rest} -> good <> "\uFFFD" <> printable(binary_part(rest, 1, byte_size(rest) - 1))
    end
  end

  defp id, do: "chatcmpl-" <> Base.encode16(:crypto.strong_rand_bytes(12), case: :lower)
end
