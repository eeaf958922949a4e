defmodule LlamaCppEx.Tools.Parser do
  @moduledoc false
  # Tool calls out of a model's answer, per family (see LlamaCppEx.Tools), whole or streamed.
  #
  # A streamed answer is split into content deltas and complete calls: content streams as it
  # arrives (holding back what may open a call, and whitespace until text follows it); a call
  # is sent once it has closed and parsed, so a stream never announces a call it must take
  # back. Reassembled, a stream gives what parse/2 gives for the whole text.

  alias LlamaCppEx.{JSON, StopMatcher, Tools}

  @hermes_open "<tool_call>"
  @hermes_close "</tool_call>"
  @mistral_open "[TOOL_CALLS]"
  @python_tag "<|python_tag|>"

  @doc "`{content | nil, calls}` for the whole answer `text`."
  @spec parse(Tools.family(), String.t()) :: {String.t() | nil, [Tools.call()]}
  def parse(family, text) do
    {events, st} = feed(new(family), text)
    {more, _} = finish(st)
    collect(events ++ more)
  end

  defp collect(events) do
    content = for {:content, t} <- events, into: "", do: t
    calls = for {:call, c} <- events, do: c
    {Tools.blank_nil(content), calls}
  end

  ## Streaming

  @type state :: %{
          family: Tools.family(),
          mode: :content | :call | :whole,
          buf: binary(),
          ws: binary(),
          started: boolean()
        }

  @doc "A streaming parser for `family`."
  def new(family), do: %{family: family, mode: :content, buf: "", ws: "", started: false}

  @doc "Feeds a chunk: `{events, state}`, events `{:content, text}` and `{:call, call}`."
  def feed(%{family: :generic} = st, chunk), do: {[], %{st | buf: st.buf <> chunk}}

  def feed(%{family: :llama3, mode: :content, started: false} = st, chunk) do
    data = st.buf <> chunk
    lead = String.trim_leading(data)

    cond do
      lead == "" ->
        {[], %{st | buf: data}}

      String.starts_with?(lead, "{") or String.starts_with?(lead, @python_tag) ->
        {[], %{st | mode: :whole, buf: data, started: true}}

      String.starts_with?(@python_tag, lead) ->
        {[], %{st | buf: data}}

      true ->
        content(%{st | started: true, buf: ""}, data)
    end
  end

  def feed(%{mode: :whole} = st, chunk), do: {[], %{st | buf: st.buf <> chunk}}
  def feed(%{family: :llama3} = st, chunk), do: content(st, chunk)

  def feed(%{mode: :content} = st, chunk) do
    data = st.buf <> chunk
    open = opener(st.family)

    case :binary.split(data, open) do
      [before, rest] ->
        {events, st} = content(%{st | buf: ""}, before)
        mode = if st.family == :mistral, do: :whole, else: :call
        {more, st} = feed(%{st | mode: mode, buf: ""}, rest)
        {events ++ more, st}

      [_] ->
        keep = StopMatcher.longest_partial(data, [open])
        {events, st} = content(%{st | buf: ""}, binary_part(data, 0, byte_size(data) - keep))
        {events, %{st | buf: binary_part(data, byte_size(data) - keep, keep)}}
    end
  end

  def feed(%{mode: :call} = st, chunk) do
    data = st.buf <> chunk

    case :binary.split(data, @hermes_close) do
      [body, rest] ->
        st = %{st | mode: :content, buf: ""}

        {events, st} =
          case hermes_call(body) do
            {:ok, call} -> {[{:call, call}], st}
            :error -> content(st, @hermes_open <> body <> @hermes_close)
          end

        {more, st} = feed(st, rest)
        {events ++ more, st}

      [_] ->
        {[], %{st | buf: data}}
    end
  end

  @doc "Ends the answer: `{events, state}` for what was held back."
  def finish(%{family: :generic, buf: buf} = st), do: {generic(buf), %{st | buf: ""}}

  def finish(%{family: :llama3, mode: :whole, buf: buf} = st),
    do: {llama3(buf), %{st | buf: ""}}

  def finish(%{family: :mistral, mode: :whole, buf: buf} = st),
    do: {mistral(buf), %{st | buf: ""}}

  # an unclosed call: a complete one still counts (models stop at the closer's first token)
  def finish(%{mode: :call, buf: buf} = st) do
    case hermes_call(buf) do
      {:ok, call} -> {[{:call, call}], %{st | buf: "", mode: :content}}
      :error -> content(%{st | buf: "", mode: :content}, @hermes_open <> buf)
    end
  end

  def finish(%{buf: buf} = st) do
    {events, st} = content(%{st | buf: ""}, buf)
    {events, st}
  end

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

  ## Families

  defp hermes_call(body) do
    with {:ok, %{"name" => name} = obj} when is_binary(name) <- JSON.decode(String.trim(body)),
         {:ok, args} <- arguments(Map.get(obj, "arguments", %{})) do
      {:ok, call(name, args, nil)}
    else
      _ -> :error
    end
  end

  defp llama3(buf) do
    text = buf |> String.trim() |> String.replace_prefix(@python_tag, "") |> String.trim()

    calls =
      text
      |> String.split(~r/;\s*(?=\{)/)
      |> Enum.map(fn part ->
        with {:ok, %{"name" => name} = obj} when is_binary(name) <- JSON.decode(part),
             {:ok, args} <- arguments(Map.get(obj, "parameters", Map.get(obj, "arguments", %{}))) do
          {:ok, call(name, args, nil)}
        else
          _ -> :error
        end
      end)

    if calls != [] and Enum.all?(calls, &match?({:ok, _}, &1)),
      do: for({:ok, c} <- calls, do: {:call, c}),
      else: raw(buf)
  end

  defp mistral(buf) do
    with {:ok, list} when is_list(list) and list != [] <- JSON.decode(String.trim(buf)),
         calls when is_list(calls) <- mistral_calls(list) do
      for c <- calls, do: {:call, c}
    else
      _ -> raw(@mistral_open <> buf)
    end
  end

  defp mistral_calls(list) do
    Enum.reduce_while(list, [], fn
      %{"name" => name} = obj, acc when is_binary(name) ->
        case arguments(Map.get(obj, "arguments", %{})) do
          {:ok, args} ->
            # Mistral's templates take back only 9-character alphanumeric ids
            id = if is_binary(obj["id"]) and obj["id"] != "", do: obj["id"], else: alnum9()
            {:cont, acc ++ [call(name, args, id)]}

          :error ->
            {:halt, :error}
        end

      _, _ ->
        {:halt, :error}
    end)
  end

  defp generic(buf) do
    case JSON.decode(String.trim(buf)) do
      {:ok, %{"tool_calls" => [_ | _] = calls}} ->
        parsed =
          Enum.map(calls, fn
            %{"name" => n} = c when is_binary(n) ->
              with {:ok, a} <- arguments(Map.get(c, "arguments", %{})), do: {:ok, call(n, a, nil)}

            _ ->
              :error
          end)

        if Enum.all?(parsed, &match?({:ok, _}, &1)),
          do: for({:ok, c} <- parsed, do: {:call, c}),
          else: raw(buf)

      {:ok, %{"response" => text}} when is_binary(text) ->
        raw(text)

      _ ->
        raw(buf)
    end
  end

  defp raw(text) do
    case String.trim(text) do
      "" -> []
      t -> [{:content, t}]
    end
  end

  # arguments as OpenAI sends them: a JSON object, encoded
  defp arguments(%{} = args), do: {:ok, JSON.encode!(args)}

  defp arguments(args) when is_binary(args) do
    case JSON.decode(args) do
      {:ok, %{} = m} -> {:ok, JSON.encode!(m)}
      _ -> :error
    end
  end

  defp arguments(_), do: :error

  defp alnum9 do
    chars = ~c"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    for <<b <- :crypto.strong_rand_bytes(9)>>, into: "", do: <<Enum.at(chars, rem(b, 62))>>
  end

  defp call(name, args, id) do
    %{
      id: id || "call_" <> Base.encode16(:crypto.strong_rand_bytes(12), case: :lower),
      type: "function",
      function: %{name: name, arguments: args}
    }
  end
end
