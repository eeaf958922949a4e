defmodule LlamaCppEx.ToolsTest do
  use ExUnit.Case, async: false

  alias LlamaCppEx.{JSON, Server, TestModels, Tools}
  alias LlamaCppEx.Tools.Parser

  doctest LlamaCppEx.Tools

  @weather %{
    type: "function",
    function: %{
      name: "get_weather",
      description: "Current weather in a city",
      parameters: %{
        type: "object",
        properties: %{city: %{type: "string"}, unit: %{type: "string", enum: ["c", "f"]}},
        required: ["city", "unit"]
      }
    }
  }

  # Recorded answers per family: {family, text, content, [{name, arguments as written}]}
  @samples [
    {:hermes,
     "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
     nil, [{"get_weather", ~s({"city": "Paris"})}]},
    {:hermes,
     "Let me check both.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n" <>
       "<tool_call>\n{\"name\": \"b\", \"arguments\": \"{\\\"y\\\": [1, 2]}\"}\n</tool_call>",
     "Let me check both.", [{"a", ~s({"x": 1})}, {"b", ~s({"y": [1, 2]})}]},
    # a model that stops at the closer's first token still called
    {:hermes, "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n", nil, [{"a", "{}"}]},
    # brackets and quotes inside strings do not end the arguments
    {:hermes,
     ~s(<tool_call>{"name": "q", "arguments": {"s": "a } \\" ] {", "n": [{"m": 1}]}}</tool_call> done),
     "done", [{"q", ~s({"s": "a } \\" ] {", "n": [{"m": 1}]})}]},
    # cut off (max_tokens): the call keeps what it has
    {:hermes, "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"k\": \"v", nil,
     [{"a", ~s({"k": "v)}]},
    # no call in the markup: content
    {:hermes, "<tool_call>\n{\"nom\": 1}\n</tool_call> ok",
     "<tool_call>\n{\"nom\": 1}\n</tool_call> ok", []},
    {:hermes, "No tools needed: 4.", "No tools needed: 4.", []},
    {:hermes, "a <tool_ca", "a <tool_ca", []},
    {:llama3, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}", nil,
     [{"get_weather", ~s({"city": "Oslo"})}]},
    {:llama3,
     "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"q\": \"x\"}}",
     nil, [{"a", "{}"}, {"b", ~s({"q": "x"})}]},
    {:llama3, "  {\"name\": \"a\", \"parameters\": ", nil, [{"a", ""}]},
    {:llama3, "  {\"nom\": 2}", "{\"nom\": 2}", []},
    {:llama3, "Paris is the capital.", "Paris is the capital.", []},
    {:mistral,
     "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}, \"id\": \"abcDEF123\"}]",
     nil, [{"get_weather", ~s({"city": "Rome"})}]},
    {:mistral,
     "Sure. [TOOL_CALLS][{\"name\": \"a\", \"arguments\": {}}, {\"name\": \"b\", \"arguments\": {\"n\": 2}}]",
     "Sure.", [{"a", "{}"}, {"b", ~s({"n": 2})}]},
    {:mistral, "[TOOL_CALLS][{\"nom\": 1}]", "[TOOL_CALLS][{\"nom\": 1}]", []},
    {:generic, "{\"tool_calls\": [{\"name\": \"a\", \"arguments\": {\"k\": true}}]}", nil,
     [{"a", ~s({"k": true})}]},
    {:generic, "{\"response\": \"Hello there\"}", "Hello there", []},
    {:generic, "plain words", "plain words", []}
  ]

  defp shape({content, calls}),
    do: {content, for(c <- calls, do: {c.function.name, c.function.arguments})}

  defp decode!(json) do
    {:ok, v} = JSON.decode(json)
    v
  end

  describe "parsing recorded answers" do
    test "each family's calls, content around them, malformed and partial answers" do
      for {family, text, content, calls} <- @samples do
        assert shape(Parser.parse(family, text)) == {content, calls}, "#{family}: #{text}"
      end
    end

    test "call ids: OpenAI-style; Mistral's 9 alphanumeric characters" do
      {_, [c]} = Parser.parse(:hermes, elem(hd(@samples), 1) |> then(& &1))
      assert c.id =~ ~r/^call_[0-9a-f]{24}$/ and c.type == "function"
      {_, [m]} = Parser.parse(:mistral, "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {}}]")
      assert m.id =~ ~r/^[A-Za-z0-9]{9}$/
    end

    test "streamed at every split point (and byte by byte), the same content and calls" do
      for {family, text, _, _} <- @samples do
        whole = shape(Parser.parse(family, text))

        splits =
          [for(<<b <- text>>, do: <<b>>)] ++
            for i <- 0..byte_size(text),
                do: [binary_part(text, 0, i), binary_part(text, i, byte_size(text) - i)]

        for chunks <- splits do
          {events, st} =
            Enum.reduce(chunks, {[], Parser.new(family)}, fn chunk, {acc, st} ->
              {evs, st} = Parser.feed(st, chunk)
              {acc ++ evs, st}
            end)

          {more, _} = Parser.finish(st)
          assert shape(Parser.collect(events ++ more)) == whole, "#{family}: #{inspect(chunks)}"
          # arguments stream as they arrive: a call's pieces come before its end
          assert Enum.all?(events ++ more, &(&1 == :call_end or match?({_, _}, &1)))
        end
      end
    end
  end

  test "with enable_thinking, reasoning is split off before calls are parsed" do
    {:ok, model} = LlamaCppEx.load_model(TestModels.smollm2_path())
    {:ok, t} = Tools.prepare(model, tools: [@weather])
    t = %{t | family: :hermes}

    gen = %LlamaCppEx.Generation{
      model: model,
      tokens: [1, 2, 3],
      logprobs: false,
      max_tokens: 20,
      sampler: nil
    }

    text =
      "<think>The user wants weather.</think>\n<tool_call>\n" <>
        ~s({"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}) <>
        "\n</tool_call>"

    result = %{text: text, reason: :eog, completion_tokens: 20, logprobs: []}
    c = LlamaCppEx.Completion.completion(gen, result, [enable_thinking: true], t)
    [%{message: m, finish_reason: "tool_calls"}] = c.choices
    assert m.reasoning_content == "The user wants weather."
    assert m.content == nil

    assert [%{function: %{name: "get_weather", arguments: ~s({"city": "Paris", "unit": "c"})}}] =
             m.tool_calls

    # cut off by max_tokens: the call keeps what it has, and the reason is "length"
    cut = %{
      result
      | text: "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"ci",
        reason: :max_tokens
    }

    [%{message: %{tool_calls: [partial]}, finish_reason: "length"}] =
      LlamaCppEx.Completion.completion(gen, cut, [], t).choices

    assert partial.function.arguments == ~s({"ci)
  end

  describe "options" do
    setup do
      {:ok, model} = LlamaCppEx.load_model(TestModels.smollm2_path())
      %{model: model}
    end

    test "bad tools and tool_choice get one clear error each", %{model: model} do
      msgs = [%{role: "user", content: "hi"}]
      ask = &LlamaCppEx.chat_completion(model, msgs, &1)

      assert {:error, "invalid tools: tool 0 needs a function name" <> _} =
               ask.(tools: [%{type: "function", function: %{description: "x"}}])

      assert {:error, "invalid tools: the parameters of \"f\": " <> _} =
               ask.(tools: [%{function: %{name: "f", parameters: %{type: "nonsense"}}}])

      assert {:error, "invalid tools: the parameters of \"f\" must be a JSON Schema map" <> _} =
               ask.(tools: [%{function: %{name: "f", parameters: "{}"}}])

      assert {:error, "invalid tools: two tools are named \"get_weather\""} =
               ask.(tools: [@weather, @weather])

      assert {:error, "invalid tool_choice: no tool named \"nope\""} =
               ask.(
                 tools: [@weather],
                 tool_choice: %{type: "function", function: %{name: "nope"}}
               )

      assert {:error, "invalid tool_choice: expected " <> _} =
               ask.(tools: [@weather], tool_choice: "sometimes")

      assert {:error, "invalid tool_choice: \"required\" needs :tools"} =
               ask.(tool_choice: "required")

      assert {:error, "invalid tools: they cannot be combined with :grammar or :json_schema"} =
               ask.(tools: [@weather], json_schema: %{type: "object"})

      assert {:error, "invalid parallel_tool_calls: " <> _} =
               ask.(tools: [@weather], parallel_tool_calls: "yes")

      assert_raise ArgumentError, ~r/unknown option: :tools/, fn ->
        LlamaCppEx.generate(model, "hi", tools: [@weather])
      end
    end

    test "families from real templates" do
      dir = Path.join(Path.expand("fixtures", __DIR__), "templates")

      for {file, family} <- [
            {"Qwen-Qwen2.5-7B-Instruct.jinja", :hermes},
            {"Qwen-Qwen3-0.6B.jinja", :hermes},
            {"NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", :hermes},
            {"meta-llama-Llama-3.1-8B-Instruct.jinja", :llama3},
            {"meta-llama-Llama-3.2-3B-Instruct.jinja", :llama3},
            {"mistralai-Mistral-Nemo-Instruct-2407.jinja", :mistral},
            {"google-gemma-2-2b-it.jinja", :generic},
            {"microsoft-Phi-3.5-mini-instruct.jinja", :generic}
          ] do
        assert Tools.family(File.read!(Path.join(dir, file))) == family, file
      end
    end
  end

  describe "constraints" do
    setup do
      {:ok, model} = LlamaCppEx.load_model(TestModels.smollm2_path())
      %{model: model}
    end

    test "every family's grammar compiles; auto waits for the opener", %{model: model} do
      for family <- [:hermes, :llama3, :mistral, :generic],
          choice <- [:auto, :required, {:function, "get_weather"}],
          parallel <- [true, false] do
        {:ok, t} = Tools.prepare(model, tools: [@weather], parallel_tool_calls: parallel)
        opts = Tools.request_options(%{t | family: family, choice: choice})

        assert :ok = LlamaCppEx.Grammar.check(model, opts[:grammar]),
               "#{family} #{inspect(choice)}"

        lazy? = family != :generic and choice == :auto
        assert Keyword.has_key?(opts, :grammar_triggers) == lazy?
      end

      {:ok, t} = Tools.prepare(model, tools: [@weather], tool_choice: "none")
      assert Tools.request_options(t) == []
    end

    test "auto: free text, then a call made well-formed from its opener on", %{model: model} do
      # one call: the grammar then ends the answer
      {:ok, t} = Tools.prepare(model, tools: [@weather], parallel_tool_calls: false)
      t = %{t | family: :hermes}
      opts = Tools.request_options(t)
      assert opts[:grammar_triggers] == ["<tool_call>"]

      # few-shot: the model opens a call by itself; the grammar then holds it to the schema
      shot =
        ~s(<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>)

      prompt = "Q: weather in Oslo?\nA: Checking. #{shot}\nQ: weather in Paris?\nA: Checking."

      {:ok, text} = LlamaCppEx.generate(model, prompt, opts ++ [max_tokens: 60, temp: 0.0])
      {content, [call]} = Tools.parse(t, text)
      assert String.contains?(text, "<tool_call>")
      assert content == nil or is_binary(content)
      assert call.function.name == "get_weather"
      assert valid?(decode!(call.function.arguments), @weather.function.parameters)

      # without the opener nothing is constrained: plain generation is unchanged
      plain_prompt = "The capital of France is"
      {:ok, want} = LlamaCppEx.generate(model, plain_prompt, max_tokens: 12, temp: 0.0)

      assert {:ok, ^want} =
               LlamaCppEx.generate(model, plain_prompt, opts ++ [max_tokens: 12, temp: 0.0])
    end
  end

  describe "generic fallback rendering" do
    test "a whole tool conversation renders on templates without tool support" do
      for path <- [TestModels.smollm2_path(), TestModels.gemma3_path()] do
        {:ok, model} = LlamaCppEx.load_model(path)
        {:ok, tools} = Tools.prepare(model, tools: [@weather])
        assert tools.family == :generic

        msgs = [
          %{role: "system", content: "Be brief."},
          %{role: "user", content: "Weather in Paris?"},
          %{
            role: "assistant",
            content: nil,
            tool_calls: [
              %{
                id: "call_1",
                type: "function",
                function: %{name: "get_weather", arguments: ~s({"city": "Paris", "unit": "c"})}
              }
            ]
          },
          %{role: "tool", tool_call_id: "call_1", name: "get_weather", content: "18 C"},
          %{role: "tool", tool_call_id: "call_2", content: "sunny"}
        ]

        {msgs2, chat_opts} = Tools.render_input(tools, msgs, [])
        assert {:ok, prompt} = LlamaCppEx.Chat.apply_template(model, msgs2, chat_opts)
        assert prompt =~ "Be brief.\n\nYou can call these tools"
        assert prompt =~ ~s("name":"get_weather")

        assert prompt =~
                 ~s({"tool_calls":[{"arguments":{"city":"Paris","unit":"c"},"name":"get_weather"}]})

        assert prompt =~
                 "Result of get_weather (call call_1): 18 C\n\nResult of (call call_2): sunny"
      end
    end
  end

  describe "end to end" do
    @tag timeout: 300_000
    test "required calls over random schemas validate, on SmolLM2 and Gemma 3" do
      for path <- [TestModels.smollm2_path(), TestModels.gemma3_path()] do
        {:ok, model} = LlamaCppEx.load_model(path)
        :rand.seed(:exsss, {7, 11, 13})

        for i <- 1..6 do
          tools = for j <- 1..3, do: random_tool("t#{i}_#{j}")
          named = Enum.random(tools).function.name

          for choice <- ["required", %{type: "function", function: %{name: named}}] do
            {:ok, r} =
              LlamaCppEx.chat_completion(model, [%{role: "user", content: "Use a tool."}],
                tools: tools,
                tool_choice: choice,
                # a small model asked for calls in parallel may repeat one until max_tokens
                parallel_tool_calls: false,
                max_tokens: 160,
                temp: 0.0
              )

            assert match?(
                     [%{message: %{tool_calls: [_ | _]}, finish_reason: "tool_calls"}],
                     r.choices
                   ),
                   "#{inspect(r.choices)} for #{inspect(tools)}"

            [%{message: %{tool_calls: calls}}] = r.choices

            for c <- calls do
              tool = Enum.find(tools, &(&1.function.name == c.function.name))
              assert tool, "#{c.function.name} is not a declared tool"
              if is_map(choice), do: assert(c.function.name == named)
              args = decode!(c.function.arguments)

              assert valid?(args, tool.function.parameters),
                     "#{inspect(args)} vs #{inspect(tool)}"
            end
          end
        end
      end
    end

    test "a two-turn conversation with a tool result, through a Server, streamed" do
      {:ok, server} =
        Server.start_link(model_path: TestModels.smollm2_path(), n_parallel: 2, n_ctx: 4096)

      {:ok, _} = TestModels.wait_model(server)
      msgs = [%{role: "user", content: "What is the weather in Paris?"}]

      chunks =
        server
        |> LlamaCppEx.stream_chat_completion(msgs,
          tools: [@weather],
          tool_choice: "required",
          parallel_tool_calls: false,
          max_tokens: 80,
          temp: 0.0
        )
        |> Enum.to_list()

      deltas = for %{choices: [c]} <- chunks, do: c
      assert List.last(deltas).finish_reason == "tool_calls"
      [call] = reassemble(deltas)
      assert call.function.name == "get_weather"
      args = decode!(call.function.arguments)
      assert valid?(args, @weather.function.parameters)

      # the same request blocking gives the same call
      {:ok, r} =
        LlamaCppEx.chat_completion(server, msgs,
          tools: [@weather],
          tool_choice: "required",
          parallel_tool_calls: false,
          max_tokens: 80,
          temp: 0.0
        )

      [%{message: %{tool_calls: [blocking]}}] = r.choices
      assert blocking.function == call.function

      turn2 =
        msgs ++
          [
            %{role: "assistant", content: nil, tool_calls: [call]},
            %{role: "tool", tool_call_id: call.id, content: "18 C and sunny"}
          ]

      {:ok, r2} =
        LlamaCppEx.chat_completion(server, turn2, tools: [@weather], max_tokens: 60, temp: 0.0)

      [%{message: m, finish_reason: finish}] = r2.choices
      # "auto" on the generic family: a call or an answer, always well-formed
      assert (finish == "tool_calls" and match?([_], m[:tool_calls])) or
               (finish in ["stop", "length"] and is_binary(m.content))

      # "none": tools rendered, nothing parsed
      {:ok, r3} =
        LlamaCppEx.chat_completion(server, msgs,
          tools: [@weather],
          tool_choice: "none",
          max_tokens: 8,
          temp: 0.0
        )

      refute Map.has_key?(hd(r3.choices).message, :tool_calls)
      GenServer.stop(server)
    end
  end

  # OpenAI clients' reassembly of streamed calls
  defp reassemble(deltas) do
    deltas
    |> Enum.flat_map(fn d -> Map.get(d.delta, :tool_calls, []) end)
    |> Enum.reduce(%{}, fn d, acc ->
      Map.update(
        acc,
        d.index,
        %{id: d[:id], function: %{name: d.function[:name], arguments: d.function.arguments}},
        fn c ->
          %{c | function: %{c.function | arguments: c.function.arguments <> d.function.arguments}}
        end
      )
    end)
    |> Enum.sort()
    |> Enum.map(&elem(&1, 1))
  end

  # Random object schemas over the JSON types, enums, bounds, arrays and nesting. Strings and
  # numbers are bounded: a 135M model left free writes digits until max_tokens.
  defp random_tool(name) do
    n = Enum.random(1..3)
    props = for k <- 1..n, into: %{}, do: {"p#{k}", random_schema(2)}
    required = props |> Map.keys() |> Enum.filter(fn _ -> :rand.uniform() < 0.7 end)

    %{
      type: "function",
      function: %{
        name: name,
        description: "tool #{name}",
        parameters: %{"type" => "object", "properties" => props, "required" => required}
      }
    }
  end

  defp random_schema(depth) do
    case Enum.random(if(depth > 0, do: 1..7, else: 1..5)) do
      1 ->
        %{"type" => "string", "maxLength" => 24}

      2 ->
        %{"type" => "integer", "minimum" => 0, "maximum" => Enum.random(1..1000)}

      3 ->
        %{"type" => "number", "minimum" => -10, "maximum" => 10}

      4 ->
        %{"type" => "boolean"}

      5 ->
        %{"type" => "string", "enum" => Enum.take_random(~w(red green blue cyan), 2)}

      6 ->
        %{"type" => "array", "items" => random_schema(depth - 1), "maxItems" => 3}

      7 ->
        %{
          "type" => "object",
          "properties" => %{"inner" => random_schema(depth - 1)},
          "required" => ["inner"]
        }
    end
  end

  # A validator for the schemas random_schema/1 makes.
  defp valid?(v, %{} = s) do
    s = Map.new(s, fn {k, x} -> {to_string(k), x} end)

    type_ok =
      case s["type"] do
        "string" -> is_binary(v)
        "integer" -> is_integer(v)
        "number" -> is_number(v)
        "boolean" -> is_boolean(v)
        "array" -> is_list(v)
        "object" -> is_map(v)
        nil -> true
      end

    type_ok and
      (s["enum"] == nil or v in Enum.map(s["enum"], &to_string/1)) and
      (s["minimum"] == nil or v >= s["minimum"]) and
      (s["maximum"] == nil or v <= s["maximum"]) and
      (s["maxItems"] == nil or length(v) <= s["maxItems"]) and
      (s["maxLength"] == nil or String.length(v) <= s["maxLength"]) and
      (s["items"] == nil or Enum.all?(v, &valid?(&1, s["items"]))) and
      object_ok?(v, s)
  end

  defp object_ok?(v, %{"type" => "object"} = s) do
    props = Map.new(s["properties"] || %{}, fn {k, x} -> {to_string(k), x} end)
    required = Enum.map(s["required"] || [], &to_string/1)

    Enum.all?(required, &Map.has_key?(v, &1)) and
      Enum.all?(v, fn {k, x} -> Map.has_key?(props, k) and valid?(x, props[k]) end)
  end

  defp object_ok?(_v, _s), do: true
end
