defmodule LlamaCppEx.Tools do
  @moduledoc """
  Tool calling (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`) on the chat routes:
  the tools are rendered by the model's own chat template, the answer is constrained so calls
  are well-formed, and parsed into `message.tool_calls`.

  ## Options (on `chat/3`, `stream_chat/3`, `chat_completion/3`, `stream_chat_completion/3`)

    * `:tools` - `[%{type: "function", function: %{name:, description:, parameters:}}]`,
      string or atom keys; `parameters` is a JSON Schema (an object schema; default
      `%{type: "object", properties: %{}}`).
    * `:tool_choice` - `"auto"` (the default when tools are given), `"none"` (tools are
      rendered, no call is parsed or constrained), `"required"` (the answer is one or more
      calls), or `%{type: "function", function: %{name: name}}` (a call of that tool).
    * `:parallel_tool_calls` - whether one answer may hold several calls. Default `true`.

  ## Families

  The call syntax is the model's, told apart by its chat template:

  | family | template mentions | a call |
  |---|---|---|
  | `:hermes` (Qwen 2.5, Qwen 3, Hermes) | `<tool_call>` | `<tool_call>\\n{"name": n, "arguments": {...}}\\n</tool_call>` |
  | `:llama3` (Llama 3.1 / 3.2 / 3.3) | `<\\|python_tag\\|>` or `"parameters"` | `{"name": n, "parameters": {...}}` (one per answer) |
  | `:mistral` (Mistral Nemo-style) | `[TOOL_CALLS]` | `[TOOL_CALLS][{"name": n, "arguments": {...}}]` |
  | `:generic` | no `tools` at all | `{"tool_calls": [{"name": n, "arguments": {...}}]}` or `{"response": text}` |

  A template that does not use `tools` gets the generic fallback: a system message (merged
  into the first one when there is one) lists the tools as JSON and asks for one JSON object,
  either `{"tool_calls": [...]}` or `{"response": "..."}`; assistant messages carrying
  `tool_calls` are rendered as that JSON, and `role: "tool"` results as user messages
  (`Result of <name> (call <id>): <content>`, consecutive results merged), so templates that
  insist on alternating turns render a whole tool conversation.

  ## Constraints

  `"required"` and a named function constrain the whole answer (llguidance) to the family's
  call syntax with arguments valid against each tool's schema. `"auto"` constrains lazily,
  as llama.cpp's grammar triggers do: the model writes freely until the family's call opener
  (`<tool_call>`, `[TOOL_CALLS]`, `<|python_tag|>` or `{"name"`) appears, and from its first
  byte on the call grammar applies (see `:grammar_triggers` in `LlamaCppEx.Sampler`). The
  generic family has no opener: its whole answer is constrained (a call object or a response
  object). With `parallel_tool_calls: false` one answer holds at most one call (the Llama 3
  format always holds one).
  """

  alias LlamaCppEx.{Grammar, JSON, Model, NIF}

  defstruct tools: [], choice: :auto, parallel: true, family: :generic

  @type family :: :hermes | :llama3 | :mistral | :generic
  @type t :: %__MODULE__{
          tools: [map()],
          choice: :auto | :none | :required | {:function, String.t()},
          parallel: boolean(),
          family: family()
        }

  @type call :: %{
          id: String.t(),
          type: String.t(),
          function: %{name: String.t(), arguments: String.t()}
        }

  @keys [:tools, :tool_choice, :parallel_tool_calls]

  @doc "The options this module reads."
  @spec option_keys() :: [atom()]
  def option_keys, do: @keys

  @doc """
  The request's tools from `opts`: `{:ok, nil}` without `:tools` (or with an empty list),
  `{:ok, %Tools{}}`, or `{:error, "invalid tools: ..."}` /
  `{:error, "invalid tool_choice: ..."}`.
  """
  @spec prepare(Model.t(), keyword()) :: {:ok, t() | nil} | {:error, String.t()}
  def prepare(%Model{} = model, opts) do
    case Keyword.get(opts, :tools) do
      nil -> no_tools(opts)
      [] -> no_tools(opts)
      tools when is_list(tools) -> build(model, tools, opts)
      other -> {:error, "invalid tools: expected a list, got #{inspect(other)}"}
    end
  end

  defp no_tools(opts) do
    case Keyword.get(opts, :tool_choice) do
      c when c in [nil, "none", "auto", :none, :auto] -> {:ok, nil}
      c -> {:error, "invalid tool_choice: #{inspect(c)} needs :tools"}
    end
  end

  defp build(model, tools, opts) do
    with {:ok, tools} <- normalize_all(tools),
         {:ok, choice} <- choice(Keyword.get(opts, :tool_choice, "auto"), tools),
         :ok <- parallel(Keyword.get(opts, :parallel_tool_calls, true)),
         :ok <- exclusive(opts, choice) do
      {template, _own, _bos, _eos} = NIF.model_chat_template(model.ref)

      {:ok,
       %__MODULE__{
         tools: tools,
         choice: choice,
         parallel: Keyword.get(opts, :parallel_tool_calls, true),
         family: family(template)
       }}
    end
  end

  defp normalize_all(tools) do
    tools
    |> Enum.with_index()
    |> Enum.reduce_while({:ok, []}, fn {tool, i}, {:ok, acc} ->
      case normalize(tool, i) do
        {:ok, t} -> {:cont, {:ok, [t | acc]}}
        error -> {:halt, error}
      end
    end)
    |> case do
      {:ok, list} -> unique(Enum.reverse(list))
      error -> error
    end
  end

  defp unique(tools) do
    names = Enum.map(tools, & &1["function"]["name"])

    case names -- Enum.uniq(names) do
      [] -> {:ok, tools}
      [dup | _] -> {:error, "invalid tools: two tools are named #{inspect(dup)}"}
    end
  end

  defp normalize(tool, i) when is_map(tool) do
    tool = stringify(tool)
    fun = tool["function"]

    cond do
      tool["type"] not in [nil, "function"] ->
        {:error, "invalid tools: tool #{i} has type #{inspect(tool["type"])}, not \"function\""}

      not is_map(fun) ->
        {:error, "invalid tools: tool #{i} has no \"function\" map"}

      not (is_binary(fun["name"]) and fun["name"] =~ ~r/^[A-Za-z0-9_.\-]{1,64}$/) ->
        {:error,
         "invalid tools: tool #{i} needs a function name of 1-64 letters, digits, _, . or -, " <>
           "got #{inspect(fun["name"])}"}

      true ->
        params = Map.get(fun, "parameters") || %{"type" => "object", "properties" => %{}}

        with :ok <- schema(params, fun["name"]) do
          fun = Map.put(fun, "parameters", params)
          {:ok, %{"type" => "function", "function" => fun}}
        end
    end
  end

  defp normalize(tool, i), do: {:error, "invalid tools: tool #{i} is not a map: #{inspect(tool)}"}

  defp schema(params, name) when is_map(params) do
    case Grammar.from_json_schema(params) do
      {:ok, _} -> :ok
      {:error, why} -> {:error, "invalid tools: the parameters of #{inspect(name)}: #{why}"}
    end
  end

  defp schema(params, name),
    do:
      {:error,
       "invalid tools: the parameters of #{inspect(name)} must be a JSON Schema map, got " <>
         inspect(params)}

  defp stringify(%{} = m), do: Map.new(m, fn {k, v} -> {to_string(k), stringify(v)} end)
  defp stringify(l) when is_list(l), do: Enum.map(l, &stringify/1)
  defp stringify(v) when is_atom(v) and v not in [nil, true, false], do: Atom.to_string(v)
  defp stringify(v), do: v

  defp choice(c, _tools) when c in ["auto", :auto], do: {:ok, :auto}
  defp choice(c, _tools) when c in ["none", :none], do: {:ok, :none}
  defp choice(c, _tools) when c in ["required", :required], do: {:ok, :required}

  defp choice(%{} = c, tools) do
    c = stringify(c)
    name = get_in(c, ["function", "name"])

    cond do
      c["type"] not in [nil, "function"] or not is_binary(name) ->
        {:error, "invalid tool_choice: #{inspect(c)}"}

      Enum.any?(tools, &(&1["function"]["name"] == name)) ->
        {:ok, {:function, name}}

      true ->
        {:error, "invalid tool_choice: no tool named #{inspect(name)}"}
    end
  end

  defp choice(c, _tools),
    do:
      {:error,
       "invalid tool_choice: expected \"auto\", \"none\", \"required\" or " <>
         "%{type: \"function\", function: %{name: name}}, got #{inspect(c)}"}

  defp parallel(p) when is_boolean(p), do: :ok

  defp parallel(p),
    do: {:error, "invalid parallel_tool_calls: expected a boolean, got #{inspect(p)}"}

  defp exclusive(opts, choice) do
    if choice != :none and (opts[:grammar] != nil or opts[:json_schema] != nil),
      do: {:error, "invalid tools: they cannot be combined with :grammar or :json_schema"},
      else: :ok
  end

  @doc """
  The family of a chat template's call syntax.

      iex> LlamaCppEx.Tools.family("{% if tools %}<tool_call>{% endif %}")
      :hermes

      iex> LlamaCppEx.Tools.family("{{ messages }}")
      :generic
  """
  @spec family(String.t()) :: family()
  def family(template) do
    cond do
      not String.contains?(template, "tools") -> :generic
      String.contains?(template, "<tool_call>") -> :hermes
      String.contains?(template, "[TOOL_CALLS]") -> :mistral
      String.contains?(template, "<|python_tag|>") -> :llama3
      String.contains?(template, "\"parameters\"") -> :llama3
      true -> :generic
    end
  end

  ## Rendering

  @doc """
  The messages and chat options to render for `tools`: the tools as the template's `tools`
  variable, or (generic family) the fallback described in the moduledoc.
  """
  @spec render_input(t() | nil, list(), keyword()) :: {list(), keyword()}
  def render_input(nil, messages, chat_opts), do: {messages, chat_opts}

  def render_input(%__MODULE__{family: :generic} = t, messages, chat_opts) do
    messages = generic_history(messages)
    messages = if t.choice == :none, do: messages, else: with_system(messages, generic_prompt(t))
    {messages, chat_opts}
  end

  def render_input(%__MODULE__{tools: tools}, messages, chat_opts) do
    kwargs = Map.new(Keyword.get(chat_opts, :chat_template_kwargs, []), fn {k, v} -> {k, v} end)
    {messages, Keyword.put(chat_opts, :chat_template_kwargs, Map.put(kwargs, "tools", tools))}
  end

  defp generic_prompt(t) do
    tools = Enum.map(allowed(t), & &1["function"])

    answer =
      case t.choice do
        :auto ->
          "either {\"tool_calls\": [{\"name\": <tool name>, \"arguments\": <arguments>}]} " <>
            "to call tools, or {\"response\": <your answer>} to answer directly"

        _ ->
          "{\"tool_calls\": [{\"name\": <tool name>, \"arguments\": <arguments>}]}"
      end

    "You can call these tools (their arguments are described by JSON Schema):\n" <>
      JSON.encode!(tools) <> "\n\nAnswer with one JSON object: " <> answer <> "."
  end

  defp with_system([first | rest] = messages, text) do
    m = stringify_keys(first)

    if m["role"] in ["system", :system] and is_binary(m["content"]),
      do: [Map.put(m, "content", m["content"] <> "\n\n" <> text) | rest],
      else: [%{"role" => "system", "content" => text} | messages]
  end

  defp with_system([], text), do: [%{"role" => "system", "content" => text}]

  defp stringify_keys({role, content}), do: %{"role" => to_string(role), "content" => content}
  defp stringify_keys(%{} = m), do: Map.new(m, fn {k, v} -> {to_string(k), v} end)
  defp stringify_keys(other), do: other

  # Assistant calls as the generic JSON; tool results as (merged) user turns.
  defp generic_history(messages) do
    messages
    |> Enum.map(&stringify_keys/1)
    |> Enum.chunk_by(&(is_map(&1) and to_string(&1["role"]) == "tool"))
    |> Enum.flat_map(fn
      [%{"role" => r} | _] = results when r in ["tool", :tool] ->
        [%{"role" => "user", "content" => Enum.map_join(results, "\n\n", &tool_result/1)}]

      other ->
        Enum.map(other, &generic_call_message/1)
    end)
  end

  defp tool_result(m) do
    name = if m["name"], do: "#{m["name"]} ", else: ""
    "Result of #{name}(call #{m["tool_call_id"] || "?"}): #{text_of(m["content"])}"
  end

  defp text_of(s) when is_binary(s), do: s
  defp text_of(nil), do: ""
  defp text_of(other), do: JSON.encode!(other)

  defp generic_call_message(%{"tool_calls" => [_ | _] = calls} = m) do
    calls =
      Enum.map(calls, fn c ->
        f = stringify(c) |> Map.get("function", %{})
        %{"name" => f["name"], "arguments" => decoded(f["arguments"])}
      end)

    m |> Map.delete("tool_calls") |> Map.put("content", JSON.encode!(%{"tool_calls" => calls}))
  end

  defp generic_call_message(m), do: m

  defp decoded(args) when is_binary(args) do
    case JSON.decode(args) do
      {:ok, v} -> v
      _ -> args
    end
  end

  defp decoded(args), do: args

  ## Constraints

  @doc """
  The generation options that keep the answer to well-formed calls: `[]` (no constraint),
  or `:grammar` (llguidance Lark) and, for `"auto"` on a family with call markup,
  `:grammar_triggers` (the grammar applies from the call's opener on).
  """
  @spec request_options(t() | nil) :: keyword()
  def request_options(nil), do: []
  def request_options(%__MODULE__{choice: :none}), do: []

  def request_options(%__MODULE__{family: :generic} = t) do
    with_calls = object([{"tool_calls", calls_array(t, "arguments")}])

    schema =
      if t.choice == :auto,
        do: %{"anyOf" => [with_calls, object([{"response", %{"type" => "string"}}])]},
        else: with_calls

    [grammar: lark(["start: ", json(schema)])]
  end

  def request_options(%__MODULE__{family: :hermes} = t) do
    body = json(%{"anyOf" => Enum.map(allowed(t), &call_schema(&1, "arguments"))})
    more = if t.parallel, do: " (\"\\n\" call)*", else: ""

    grammar =
      lark(["start: call", more, "\ncall: \"<tool_call>\\n\" ", body, " \"\\n</tool_call>\""])

    [grammar: grammar] ++ triggers(t, ["<tool_call>"])
  end

  def request_options(%__MODULE__{family: :llama3} = t) do
    body = json(%{"anyOf" => Enum.map(allowed(t), &call_schema(&1, "parameters"))})
    grammar = lark(["start: body | \"<|python_tag|>\" body\nbody: ", body])
    [grammar: grammar] ++ triggers(t, ["<|python_tag|>", "{\"name\""])
  end

  def request_options(%__MODULE__{family: :mistral} = t) do
    grammar = lark(["start: \"[TOOL_CALLS]\" ", json(calls_array(t, "arguments"))])
    [grammar: grammar] ++ triggers(t, ["[TOOL_CALLS]"])
  end

  # "auto": the model may answer in words; its calls are constrained from their opener on
  defp triggers(%__MODULE__{choice: :auto}, openers), do: [grammar_triggers: openers]
  defp triggers(_t, _openers), do: []

  defp calls_array(t, args_key) do
    calls = %{
      "type" => "array",
      "items" => %{"anyOf" => Enum.map(allowed(t), &call_schema(&1, args_key))},
      "minItems" => 1
    }

    if t.parallel, do: calls, else: Map.put(calls, "maxItems", 1)
  end

  defp allowed(%__MODULE__{choice: {:function, name}, tools: tools}),
    do: Enum.filter(tools, &(&1["function"]["name"] == name))

  defp allowed(%__MODULE__{tools: tools}), do: tools

  # name first, so the call reads (and streams) as models write it
  defp call_schema(tool, args_key) do
    f = tool["function"]
    object([{"name", %{"const" => f["name"]}}, {args_key, f["parameters"]}])
  end

  defp object(props),
    do: %{
      "type" => "object",
      "properties" => {:ordered, props},
      "required" => Enum.map(props, &elem(&1, 0))
    }

  defp json(schema), do: Grammar.json_schema_lark!(schema)

  defp lark(parts), do: IO.iodata_to_binary(["%llguidance {}\n", parts, "\n"])

  ## Parsing

  @doc """
  Splits an answer into `{content, calls}`: `content` the text outside calls (trimmed; nil
  when empty), `calls` OpenAI-shaped (`arguments` a JSON string). Text that does not parse
  as the family's calls stays content.
  """
  @spec parse(t(), String.t()) :: {String.t() | nil, [call()]}
  def parse(%__MODULE__{choice: :none}, text), do: {blank_nil(text), []}
  def parse(%__MODULE__{family: family}, text), do: __MODULE__.Parser.parse(family, text)

  @doc false
  def blank_nil(text) do
    case String.trim(text) do
      "" -> nil
      t -> t
    end
  end
end
