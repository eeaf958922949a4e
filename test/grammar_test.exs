defmodule LlamaCppEx.GrammarTest do
  use ExUnit.Case, async: false

  alias LlamaCppEx.{Grammar, JSON, Model, Sampler, Server, TestModels, Tokenizer}

  @moduletag timeout: 600_000

  setup_all do
    %{model: TestModels.smollm2()}
  end

  describe "Grammar.from_json_schema/1" do
    test "returns GBNF with a root rule that the sampler accepts", %{model: model} do
      schema = %{
        "type" => "object",
        "properties" => %{
          "name" => %{"type" => "string"},
          "tags" => %{"type" => "array", "items" => %{"enum" => ["a", "b"]}, "maxItems" => 2}
        },
        "required" => ["name"]
      }

      assert {:ok, gbnf} = Grammar.from_json_schema(schema)
      assert gbnf =~ ~r/^root ::= /m
      assert :ok = Sampler.validate_grammar(model, grammar: gbnf)
      assert Grammar.from_json_schema!(schema) == gbnf
    end

    test "the contract's errors" do
      assert {:error, msg} = Grammar.from_json_schema(%{"type" => "frobnicate"})
      assert msg =~ "Unrecognized schema"

      assert {:error, msg} = Grammar.from_json_schema(%{"$ref" => "#/$defs/missing"})
      assert msg =~ "Error resolving ref"

      deep =
        Enum.reduce(1..70, %{"type" => "string"}, fn _, acc ->
          %{"type" => "object", "properties" => %{"a" => acc}}
        end)

      assert {:error, "schema nested too deeply"} = Grammar.from_json_schema(deep)

      big = %{"enum" => [String.duplicate("x", 1_100_000)]}
      assert {:error, "schema too large"} = Grammar.from_json_schema(big)

      assert_raise ArgumentError,
                   ~r/failed to convert JSON schema to grammar: Unrecognized/,
                   fn ->
                     Grammar.from_json_schema!(%{"type" => "frobnicate"})
                   end
    end
  end

  describe "validation" do
    test "Sampler.validate_grammar/2 and the limits", %{model: model} do
      assert :ok = Sampler.validate_grammar(model, grammar: nil)
      assert :ok = Sampler.validate_grammar(model, grammar: "")
      assert :ok = Sampler.validate_grammar(model, [])
      assert :ok = Sampler.validate_grammar(model, grammar: ~S{root ::= "a" [b-d]* ("e" | "f")?})

      assert :ok =
               Sampler.validate_grammar(model,
                 grammar: ~S{start ::= "x"},
                 grammar_root: "start"
               )

      for bad <- ["root ::= missing", ~S{root ::= "open}, "not a grammar", ~S{other ::= "x"}] do
        assert {:error, :invalid_grammar} = Sampler.validate_grammar(model, grammar: bad), bad
      end

      nest = fn n ->
        "root ::= " <> String.duplicate("(", n) <> ~S{"a"} <> String.duplicate(")", n)
      end

      assert :ok = Sampler.validate_grammar(model, grammar: nest.(60))
      assert {:error, :invalid_grammar} = Sampler.validate_grammar(model, grammar: nest.(65))
      assert {:error, :invalid_grammar} = Sampler.validate_grammar(model, grammar: nest.(200))

      huge = ~S{root ::= "} <> String.duplicate("a", 1_048_576) <> ~S{"}
      assert {:error, :invalid_grammar} = Sampler.validate_grammar(model, grammar: huge)

      assert {:error, "undefined rule identifier 'missing'"} =
               Grammar.check(model, "root ::= missing")
    end

    test "Sampler.create/2 and generation answer {:error, :invalid_grammar}", %{model: model} do
      assert {:error, :invalid_grammar} = Sampler.create(model, grammar: "root ::= (")
      assert {:error, :invalid_grammar} = LlamaCppEx.generate(model, "Hi", grammar: "root ::= (")

      assert [{:error, :invalid_grammar}] =
               Enum.to_list(LlamaCppEx.stream(model, "Hi", grammar: "x"))
    end

    test "both :grammar and :json_schema raise before the model is touched" do
      for fun <- [&LlamaCppEx.generate/3, &LlamaCppEx.stream/3] do
        assert_raise ArgumentError, "cannot use both :grammar and :json_schema options", fn ->
          fun.(%Model{ref: nil}, "x",
            grammar: "root ::= \"a\"",
            json_schema: %{"type" => "string"}
          )
        end
      end

      assert_raise ArgumentError, ~r/failed to convert JSON schema/, fn ->
        LlamaCppEx.generate(%Model{ref: nil}, "x", json_schema: %{"type" => "frob"})
      end
    end
  end

  describe "constrained generation" do
    test ~S{root ::= "hello world" yields exactly that on both models}, %{model: model} do
      {:ok, gemma} = LlamaCppEx.load_model(TestModels.gemma3_path())

      for m <- [model, gemma] do
        assert {:ok, "hello world"} =
                 LlamaCppEx.generate(m, "Say anything.",
                   grammar: ~S{root ::= "hello world"},
                   temp: 0.0
                 )

        assert {:ok, "hello world"} =
                 LlamaCppEx.chat(m, [%{role: "user", content: "Hi"}],
                   grammar: ~S{root ::= "hello world"},
                   temp: 0.0
                 )
      end
    end

    test "streams and chat completions honour :json_schema", %{model: model} do
      schema = %{
        "type" => "object",
        "properties" => %{
          "city" => %{"type" => "string", "maxLength" => 20},
          "population" => %{"type" => "integer", "minimum" => 0, "maximum" => 50_000_000}
        },
        "required" => ["city", "population"],
        "additionalProperties" => false
      }

      text =
        model
        |> LlamaCppEx.stream("Name a large city as JSON.",
          json_schema: schema,
          temp: 0.0,
          max_tokens: 60
        )
        |> Enum.join()

      assert {:ok, %{"city" => city, "population" => pop}} = JSON.decode(text)
      assert is_binary(city) and is_integer(pop) and pop in 0..50_000_000

      msgs = [%{role: "user", content: "Name a large city as JSON."}]

      {:ok, c} =
        LlamaCppEx.chat_completion(model, msgs,
          json_schema: schema,
          temp: 0.8,
          seed: 5,
          max_tokens: 60
        )

      [%{message: %{content: content}, finish_reason: "stop"}] = c.choices
      assert {:ok, %{"city" => _, "population" => _}} = JSON.decode(content)

      chunks =
        LlamaCppEx.stream_chat_completion(model, msgs,
          json_schema: schema,
          temp: 0.0,
          max_tokens: 60
        )

      content =
        chunks
        |> Enum.map(fn %{choices: [%{delta: d}]} -> Map.get(d, :content, "") end)
        |> Enum.join()

      assert {:ok, %{"city" => _}} = JSON.decode(content)
    end

    test "regex-like GBNF", %{model: model} do
      grammar = ~S"""
      # a date and a time
      root ::= date "T" time
      date ::= [0-9]{4} "-" ("0" [1-9] | "1" [0-2]) "-" ("0" [1-9] | [12] [0-9] | "3" [01])
      time ::= ([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9]
      """

      {:ok, text} =
        LlamaCppEx.generate(model, "When did it happen?", grammar: grammar, temp: 0.8, seed: 11)

      assert text =~ ~r/^\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])T([01]\d|2[0-3]):[0-5]\d$/
    end
  end

  describe "samplers beyond the contract" do
    test "every option is accepted and seeded runs reproduce", %{model: model} do
      variants = [
        [typical_p: 0.9],
        [top_n_sigma: 1.5],
        [xtc_probability: 0.5, xtc_threshold: 0.1],
        [dry_multiplier: 0.8, dry_base: 1.75, dry_allowed_length: 2, dry_penalty_last_n: -1],
        [mirostat: 1, mirostat_tau: 5.0, mirostat_eta: 0.1],
        [mirostat: 2, mirostat_tau: 4.0],
        [dynatemp_range: 0.5, dynatemp_exponent: 1.0],
        [penalty_repeat: 1.3, penalty_last_n: 16],
        [min_keep: 5, top_p: 0.5],
        [logit_bias: %{0 => -5.0}]
      ]

      for v <- variants do
        opts = [seed: 1234, temp: 0.9, max_tokens: 24] ++ v
        {:ok, a} = LlamaCppEx.generate(model, "Once upon a time", opts)
        {:ok, b} = LlamaCppEx.generate(model, "Once upon a time", opts)
        assert a == b, inspect(v)
        assert a != ""
      end
    end

    test "logit_bias bans a token and DRY breaks a loop", %{model: model} do
      prompt = "1, 2, 3,"
      {:ok, greedy} = LlamaCppEx.generate(model, prompt, temp: 0.0, max_tokens: 1)
      {:ok, [banned]} = Tokenizer.encode(model, greedy, add_special: false)

      {:ok, other} =
        LlamaCppEx.generate(model, prompt,
          temp: 0.0,
          max_tokens: 1,
          logit_bias: [{banned, :neg_infinity}]
        )

      assert other != greedy

      looping = String.duplicate("the cat sat on the mat and ", 12)
      {:ok, plain} = LlamaCppEx.generate(model, looping, temp: 0.0, max_tokens: 40)

      {:ok, dry} =
        LlamaCppEx.generate(model, looping,
          temp: 0.0,
          max_tokens: 40,
          dry_multiplier: 2.0,
          dry_penalty_last_n: 256
        )

      count = fn text -> length(String.split(text, "the cat sat on the mat")) - 1 end
      assert count.(plain) >= 3
      assert count.(dry) < count.(plain)
    end

    test "bad values are errors, unknown options raise", %{model: model} do
      assert {:error, "invalid mirostat: 3"} = Sampler.create(model, mirostat: 3)
      assert {:error, _} = Sampler.create(model, logit_bias: %{"a" => 1})
      assert {:error, _} = Sampler.create(model, logit_bias: %{999_999_999 => 1.0})
      assert {:error, _} = Sampler.create(model, dry_sequence_breakers: [1])

      assert_raise ArgumentError, ~r/typical_pp/, fn ->
        LlamaCppEx.generate(model, "x", typical_pp: 0.5)
      end
    end
  end

  describe "Server" do
    setup do
      {:ok, server} =
        Server.start_link(
          model_path: TestModels.smollm2_path(),
          n_parallel: 8,
          n_ctx: 8192,
          temp: 0.0
        )

      {:ok, model} = wait_model(server)
      # the server is linked to the test process and may already be stopping with it
      on_exit(fn ->
        try do
          GenServer.stop(server)
        catch
          :exit, _ -> :ok
        end
      end)

      %{server: server, model: model}
    end

    defp wait_model(server) do
      case Server.fetch_model(server) do
        {:error, :not_ready} -> wait_model(server)
        other -> other
      end
    end

    test "8 concurrent requests with different schemas", %{server: server, model: model} do
      schemas =
        for i <- 1..8 do
          key = "field#{i}"

          type =
            Enum.at(
              [
                %{"type" => "integer", "minimum" => i, "maximum" => i * 10},
                %{"type" => "boolean"},
                %{"enum" => ["red", "green", "blue"]},
                %{"type" => "string", "maxLength" => 10},
                %{
                  "type" => "array",
                  "items" => %{"type" => "integer", "minimum" => 0, "maximum" => 9},
                  "minItems" => 2,
                  "maxItems" => 3
                }
              ],
              rem(i, 5)
            )

          {key, type,
           %{
             "type" => "object",
             "properties" => %{key => type},
             "required" => [key],
             "additionalProperties" => false
           }}
        end

      tasks =
        for {{key, type, schema}, i} <- Enum.with_index(schemas) do
          Task.async(fn ->
            msgs = [%{role: "user", content: "Fill in #{key} as JSON."}]

            opts =
              [json_schema: schema, max_tokens: 48] ++
                if(rem(i, 2) == 0, do: [temp: 0.0], else: [temp: 0.8, seed: i])

            {:ok, c} = LlamaCppEx.chat_completion(server, msgs, opts)
            {key, type, hd(c.choices).message.content}
          end)
        end

      for {key, type, content} <- Task.await_many(tasks, 300_000) do
        assert {:ok, %{^key => value} = obj} = JSON.decode(content), content
        assert map_size(obj) == 1
        check_type(type, value)
      end

      _ = model
    end

    test "an invalid grammar is rejected at admission and never takes a slot", %{
      server: server,
      model: model
    } do
      {:ok, ids} = Tokenizer.encode(model, "Hello")
      before = Server.get_stats(server)

      assert {:error, :invalid_grammar} =
               Server.generate_tokens(server, ids, grammar: "root ::= ((")

      assert [{:error, :invalid_grammar}] =
               Enum.to_list(Server.stream_tokens(server, ids, grammar: "nope"))

      stats = Server.get_stats(server)
      assert stats.active_slots == 0 and stats.queue_depth == 0
      assert Map.get(stats, :requests_total, 0) == Map.get(before, :requests_total, 0)

      assert {:ok, answer} =
               Server.generate_tokens(server, ids,
                 grammar: ~S{root ::= "yes" | "no"},
                 max_tokens: 8
               )

      assert answer in ["yes", "no"]
    end
  end

  defp check_type(%{"type" => "integer", "minimum" => lo, "maximum" => hi}, v),
    do: assert(is_integer(v) and v >= lo and v <= hi, inspect(v))

  defp check_type(%{"type" => "boolean"}, v), do: assert(is_boolean(v))
  defp check_type(%{"enum" => e}, v), do: assert(v in e)

  defp check_type(%{"type" => "string", "maxLength" => n}, v),
    do: assert(is_binary(v) and String.length(v) <= n)

  defp check_type(%{"type" => "array"}, v),
    do: assert(is_list(v) and length(v) in 2..3 and Enum.all?(v, &(&1 in 0..9)), inspect(v))
end
