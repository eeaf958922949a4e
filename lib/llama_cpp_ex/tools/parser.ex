defmodule LlamaCppEx.Tools.Parser do
  @moduledoc false
  # Tool calls out of a model's answer, per family (see LlamaCppEx.Tools), whole or streamed.
  #
  # Calls live in a region of the answer: a `<tool_call>…</tool_call>` body (Hermes/Qwen),
  # what follows `[TOOL_CALLS]` (Mistral), the whole answer when it opens with `{` or
  # `<|python_tag|>` (Llama 3.x) or always (generic). In a region each call is a JSON object
  # `{"name": n, "arguments" | "parameters": value, …}`; once its name and the key of its
  # arguments have been read the call is announced, and the value's bytes stream as they
  # arrive until the value closes. Content outside regions streams as it arrives, holding
  # back what may open a region and whitespace until text follows it. A region in which no
  # call starts is content after all (generic: its `{"response": text}`).
  #
  # Events: `{:content, text}`, `{:call_start, %{id, name}}`, `{:call_args, text}`,
  # `:call_end`. parse/2 is the stream run on the whole text, so a streamed answer
  # reassembles into what parse/2 gives, wherever the chunks split it. A call cut off by the
  # end of the answer (max_tokens) keeps the arguments it has.

  alias LlamaCppEx.{JSON, StopMatcher, Tools}

  @hermes_open "<tool_call>"
  @hermes_close "</tool_call>"
  @mistral_open "[TOOL_CALLS]"
  @python_tag "<|python_tag|>"
  @header ~r/\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*/

  @type event ::
          {:content, String.t()}
          | {:call_start, %{id: String.t(), name: String.t()}}
          | {:call_args, String.t()}
          | :call_end

  @doc "`{content | nil, calls}` for the whole answer `text`."
  @spec parse(Tools.family(), String.t()) :: {String.t() | nil, [Tools.call()]}
  def parse(family, text) do
    {events, st} = feed(new(family), text)
    {more, _} = finish(st)
    collect(events ++ more)
  end

  @doc "Assembles events into `{content | nil, calls}`."
  @spec collect([event()]) :: {String.t() | nil, [Tools.call()]}
  def collect(events) do
    {content, calls} =
      Enum.reduce(events, {"", []}, fn
        {:content, t}, {c, calls} ->
          {c <> t, calls}

        {:call_start, %{id: id, name: name}}, {c, calls} ->
          {c, [%{id: id, type: "function", function: %{name: name, arguments: ""}} | calls]}

        {:call_args, t}, {c, [call | rest]} ->
          {c, [put_in(call.function.arguments, call.function.arguments <> t) | rest]}

        :call_end, acc ->
          acc
      end)

    {Tools.blank_nil(content), Enum.reverse(calls)}
  end

  ## Streaming

  @doc "A streaming parser for `family`."
  def new(family) do
    mode = if family == :generic, do: :region, else: :content
    %{family: family, mode: mode, buf: "", ws: "", started: false, region: region()}
  end

  @doc "Feeds a chunk: `{events, state}`."
  def feed(%{mode: :region, family: :hermes} = st, chunk) do
    data = st.buf <> chunk

    case :binary.split(data, @hermes_close) do
      [body, rest] ->
        {events, st} = region_feed(%{st | buf: ""}, body)
        {closed, st} = close_region(st, @hermes_close)
        {more, st} = feed(%{st | mode: :content}, rest)
        {events ++ closed ++ more, st}

      [_] ->
        # what may be the start of the closer waits for the next chunk
        keep = StopMatcher.longest_partial(data, [@hermes_close])
        {events, st} = region_feed(%{st | buf: ""}, binary_part(data, 0, byte_size(data) - keep))
        {events, %{st | buf: binary_part(data, byte_size(data) - keep, keep)}}
    end
  end

  def feed(%{mode: :region} = st, chunk), do: region_feed(st, chunk)

  def feed(%{family: :llama3, started: false} = st, chunk) do
    data = st.buf <> chunk
    lead = String.trim_leading(data)

    cond do
      lead == "" ->
        {[], %{st | buf: data}}

      String.starts_with?(lead, "{") or String.starts_with?(lead, @python_tag) ->
        region_feed(%{st | mode: :region, buf: "", started: true}, lead)

      String.starts_with?(@python_tag, lead) ->
        {[], %{st | buf: data}}

      true ->
        content(%{st | started: true, buf: ""}, data)
    end
  end

  def feed(%{family: :llama3} = st, chunk), do: content(st, chunk)

  def feed(%{mode: :content} = st, chunk) do
    data = st.buf <> chunk
    open = opener(st.family)

    case :binary.split(data, open) do
      [before, rest] ->
        {events, st} = content(%{st | buf: ""}, before)
        st = %{st | mode: :region, region: region(open)}
        {more, st} = feed(st, rest)
        {events ++ more, st}

      [_] ->
        keep = StopMatcher.longest_partial(data, [open])
        {events, st} = content(%{st | buf: ""}, binary_part(data, 0, byte_size(data) - keep))
        {events, %{st | buf: binary_part(data, byte_size(data) - keep, keep)}}
    end
  end

  @doc "Ends the answer: `{events, state}` for what was held back."
  def finish(%{mode: :region, family: :hermes} = st) do
    {events, st} = region_feed(%{st | buf: ""}, st.buf)
    {closed, st} = close_region(st, "")
    {events ++ closed, st}
  end

  def finish(%{mode: :region} = st), do: close_region(st, "")

  def finish(%{buf: buf} = st), do: content(%{st | buf: ""}, buf)

  defp opener(:hermes), do: @hermes_open
  defp opener(:mistral), do: @mistral_open

  # Content, dropping leading whitespace and holding trailing whitespace until text follows.
  defp content(st, ""), do: {[], st}

  defp content(st, text) do
    text = if st.started, do: text, else: String.trim_leading(text)

    case text do
      "" ->
        {[], st}

      _ ->
        body = String.trim_trailing(text)
        tail = binary_part(text, byte_size(body), byte_size(text) - byte_size(body))

        if body == "",
          do: {[], %{st | ws: st.ws <> tail, started: true}},
          else: {[{:content, st.ws <> body}], %{st | ws: tail, started: true}}
    end
  end

  ## Regions

  # `opener`: the markup that opened the region, given back as content if no call starts
  defp region(opener \\ ""),
    do: %{opener: opener, raw: "", pending: "", phase: :seek, calls: 0}

  defp region_feed(st, text) do
    r = st.region
    r = %{r | raw: r.raw <> text, pending: r.pending <> text}
    {events, r} = scan(r, st.family, [])
    {events, %{st | region: r}}
  end

  defp scan(%{phase: :seek, pending: p} = r, family, acc) do
    case Regex.run(@header, p, return: :index) do
      [{start, len}, {ns, nl}] ->
        {:ok, name} = JSON.decode(~s(") <> binary_part(p, ns, nl) <> ~s("))
        rest = binary_part(p, start + len, byte_size(p) - start - len)
        call = {:call_start, %{id: call_id(family), name: name}}

        scan(%{r | pending: rest, phase: {:value, value_scanner()}, calls: r.calls + 1}, family, [
          call | acc
        ])

      nil ->
        {Enum.reverse(acc), r}
    end
  end

  defp scan(%{phase: {:value, sc}, pending: p} = r, family, acc) do
    case value_step(sc, p, 0) do
      {:more, sc, emit} ->
        {Enum.reverse(emit_args(acc, emit)), %{r | pending: "", phase: {:value, sc}}}

      {:done, emit, rest} ->
        acc = [:call_end | emit_args(acc, emit)]
        scan(%{r | pending: rest, phase: :seek}, family, acc)
    end
  end

  defp emit_args(acc, ""), do: acc
  defp emit_args(acc, text), do: [{:call_args, text} | acc]

  # The end of a region (`closer`: the markup that closed it): a call cut off ends where the
  # text did; no call at all is content.
  defp close_region(%{region: r} = st, closer) do
    st = %{st | mode: :content, region: region(), buf: ""}

    cond do
      r.calls > 0 and r.phase != :seek -> {[:call_end], st}
      r.calls > 0 -> {[], st}
      st.family == :generic -> content(st, response(r.raw))
      true -> content(st, r.opener <> r.raw <> closer)
    end
  end

  defp response(raw) do
    case JSON.decode(String.trim(raw)) do
      {:ok, %{"response" => text}} when is_binary(text) -> text
      _ -> raw
    end
  end

  ## The arguments' value, byte by byte: an object or array streams as it arrives until its
  ## brackets balance (strings and escapes followed); a string streams nothing until it
  ## closes, then gives its decoded text (arguments sent as a JSON string).

  defp value_scanner, do: %{kind: nil, depth: 0, in_str: false, esc: false, str: ""}

  defp value_step(sc, p, i) when i >= byte_size(p) do
    case sc.kind do
      :string -> {:more, %{sc | str: sc.str <> p}, ""}
      _ -> {:more, sc, binary_part(p, 0, i)}
    end
  end

  defp value_step(%{kind: nil} = sc, p, i) do
    case :binary.at(p, i) do
      c when c in [?\s, ?\n, ?\r, ?\t] ->
        value_step(sc, binary_part(p, i + 1, byte_size(p) - i - 1), 0)

      c when c in [?{, ?[] ->
        value_step(%{sc | kind: :container, depth: 1}, p, i + 1)

      ?" ->
        string_step(%{sc | kind: :string}, binary_part(p, i + 1, byte_size(p) - i - 1))

      _ ->
        # a scalar where an object belongs: taken whole up to its delimiter
        case Regex.run(~r/^[^,}\]\s]*/, binary_part(p, i, byte_size(p) - i)) do
          [lit] when byte_size(lit) < byte_size(p) - i ->
            rest = binary_part(p, i + byte_size(lit), byte_size(p) - i - byte_size(lit))
            {:done, lit, rest}

          _ ->
            {:more, sc, ""}
        end
    end
  end

  defp value_step(%{kind: :string} = sc, p, _i), do: string_step(sc, p)

  defp value_step(%{kind: :container} = sc, p, i) do
    c = :binary.at(p, i)

    sc =
      cond do
        sc.esc -> %{sc | esc: false}
        sc.in_str and c == ?\\ -> %{sc | esc: true}
        c == ?" -> %{sc | in_str: not sc.in_str}
        sc.in_str -> sc
        c in [?{, ?[] -> %{sc | depth: sc.depth + 1}
        c in [?}, ?]] -> %{sc | depth: sc.depth - 1}
        true -> sc
      end

    if sc.depth == 0 do
      {:done, binary_part(p, 0, i + 1), binary_part(p, i + 1, byte_size(p) - i - 1)}
    else
      value_step(sc, p, i + 1)
    end
  end

  defp string_step(sc, p) do
    data = sc.str <> p

    case Regex.run(~r/^((?:[^"\\]|\\.)*)"/s, data, return: :index) do
      [{0, len}, _] ->
        literal = binary_part(data, 0, len)
        rest = binary_part(data, len, byte_size(data) - len)

        text =
          case JSON.decode(~s(") <> literal) do
            {:ok, s} -> s
            _ -> binary_part(literal, 0, len - 1)
          end

        {:done, text, rest}

      nil ->
        {:more, %{sc | str: data}, ""}
    end
  end

  # Mistral's templates take back only 9-character alphanumeric ids
  defp call_id(:mistral) do
    chars = ~c"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    for <<b <- :crypto.strong_rand_bytes(9)>>, into: "", do: <<Enum.at(chars, rem(b, 62))>>
  end

  defp call_id(_), do: "call_" <> Base.encode16(:crypto.strong_rand_bytes(12), case: :lower)
end
