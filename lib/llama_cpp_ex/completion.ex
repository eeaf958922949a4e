defmodule LlamaCppEx.Completion do
  @moduledoc false
  # OpenAI-shaped results (`LlamaCppEx.ChatCompletion`, `LlamaCppEx.ChatCompletionChunk`)
  # built from a request's events, the same for both routes.

  alias LlamaCppEx.{ChatCompletion, ChatCompletionChunk, Generation, Model, Thinking, Tools}
  alias LlamaCppEx.Tools.Parser

  @doc """
  A whole completion of the prepared request `gen` from `Source.collect/1`'s result
  (`:enable_thinking` in `opts` splits `<think>` blocks; `tools`, when given, parses calls
  out of the answer).
  """
  @spec completion(Generation.t(), map(), keyword(), Tools.t() | nil) :: ChatCompletion.t()
  def completion(%Generation{} = gen, %{text: text, reason: reason} = r, opts, tools \\ nil) do
    {model, n_prompt, n} = {gen.model, length(gen.tokens), r.completion_tokens}
    {reasoning, content} = if opts[:enable_thinking], do: Thinking.parse(text), else: {"", text}
    {content, calls} = if tools, do: Tools.parse(tools, content), else: {content, []}

    message = %{
      role: "assistant",
      content: content,
      reasoning_content: if(reasoning == "", do: nil, else: reasoning)
    }

    choice = %{
      index: 0,
      message: if(calls == [], do: message, else: Map.put(message, :tool_calls, calls)),
      finish_reason: finish_reason(reason, calls != [])
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

  @doc """
  `max_tokens` → \"length\" (a call it cut off included); else \"tool_calls\" when the answer
  called tools, \"stop\" when not.
  """
  @spec finish_reason(atom(), boolean()) :: String.t()
  def finish_reason(reason, called? \\ false)
  def finish_reason(reason, _) when reason not in [:eog, :stop], do: "length"
  def finish_reason(_reason, true), do: "tool_calls"
  def finish_reason(_reason, false), do: "stop"

  ## Tool calls in a chunk stream

  @typep calls :: nil | %{parser: map(), sent: non_neg_integer()}

  @doc "The tool-call state of a chunk stream (nil without tools)."
  @spec calls_stream(Tools.t() | nil) :: calls()
  def calls_stream(nil), do: nil
  def calls_stream(%Tools{choice: :none}), do: nil
  def calls_stream(%Tools{family: f}), do: %{parser: Parser.new(f), sent: 0}

  @doc "Content text in, deltas out: `{deltas, state}`."
  @spec feed_calls(calls(), String.t()) :: {[map()], calls()}
  def feed_calls(nil, text), do: {[%{content: text}], nil}

  def feed_calls(st, text) do
    {events, parser} = Parser.feed(st.parser, text)
    deltas(events, %{st | parser: parser})
  end

  @doc "The deltas held back until the answer ended."
  @spec finish_calls(calls()) :: {[map()], calls()}
  def finish_calls(nil), do: {[], nil}

  def finish_calls(st) do
    {events, parser} = Parser.finish(st.parser)
    deltas(events, %{st | parser: parser})
  end

  @doc "Whether the stream sent a call."
  @spec called?(calls()) :: boolean()
  def called?(nil), do: false
  def called?(%{sent: n}), do: n > 0

  # a call as OpenAI streams one: its index, id, type and name, then its arguments in pieces
  defp deltas(events, st) do
    Enum.flat_map_reduce(events, st, fn
      {:content, t}, st ->
        {[%{content: t}], st}

      {:call_start, %{id: id, name: name}}, st ->
        head = %{index: st.sent, id: id, type: "function", function: %{name: name, arguments: ""}}
        {[%{tool_calls: [head]}], %{st | sent: st.sent + 1}}

      {:call_args, t}, st ->
        {[%{tool_calls: [%{index: st.sent - 1, function: %{arguments: t}}]}], st}

      :call_end, st ->
        {[], st}
    end)
  end

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
