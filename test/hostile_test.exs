defmodule LlamaCppEx.HostileTest do
  @moduledoc """
  The hostile inputs of the issue "Never take the VM down", each run in a fresh OS process
  (`LlamaCppEx.Hostile`): before the fix these segfaulted, aborted or hung the VM. Each case
  must end within its bound with an error or a correct result, and its VM must be alive at
  the end (the child reports back only if it is).
  """
  use ExUnit.Case, async: false

  alias LlamaCppEx.Hostile

  @moduletag :hostile
  @moduletag timeout: 600_000

  # Runs `body` in a child VM and returns what it evaluated to (or what it raised); fails on a
  # crash, a hang past `limit_ms`, or a case that took longer than `max_ms` itself.
  defp child!(body, opts \\ []) do
    limit = Keyword.get(opts, :limit_ms, 60_000)

    case Hostile.run(body, limit_ms: limit) do
      {:ok, %{ms: ms} = outcome} ->
        max_ms = Keyword.get(opts, :max_ms, 10_000)
        assert ms <= max_ms, "took #{ms} ms (bound #{max_ms} ms): #{inspect(outcome)}"
        outcome

      {:crashed, status, output} ->
        flunk("the VM died (exit status #{status}):\n#{String.slice(output, -4000, 4000)}")

      {:timeout, output} ->
        flunk("still running after #{limit} ms:\n#{String.slice(output, -4000, 4000)}")
    end
  end

  @model "model = LlamaCppEx.TestModels.smollm2()\n"

  # A vocab-only model whose chat template is `template`, and the result of rendering one
  # message with it.
  defp render_template(template) do
    """
    path = Path.join(System.tmp_dir!(), "hostile_tpl_\#{System.unique_integer([:positive])}.gguf")
    LlamaCppEx.GgufWriter.write!(path, LlamaCppEx.GgufWriter.tiny_vocab(#{inspect(template)}))
    {:ok, model} = LlamaCppEx.Model.load(path, vocab_only: true)
    File.rm!(path)
    LlamaCppEx.Chat.apply_template(model, [%{role: "user", content: "hi"}])
    """
  end

  describe "crashes of the VM (cases 1-5)" do
    test "1. a GBNF chain of 1000 rules compiles or is rejected, from check/2 and generate" do
      body =
        @model <>
          ~S"""
          g = Enum.map_join(0..999, "\n", &~s(r#{&1} ::= "a" r#{&1 + 1})) <> ~s(\nr1000 ::= "b"\nroot ::= r0)
          {LlamaCppEx.Grammar.check(model, g),
           LlamaCppEx.generate(model, "Say a:", grammar: g, max_tokens: 4, temp: 0.0)}
          """

      assert %{value: {check, gen}} = child!(body, max_ms: 30_000)
      assert check == :ok
      assert {:ok, text} = gen
      assert text == String.duplicate("a", String.length(text))
    end

    test "2. a JSON Schema with 1000 required properties" do
      body =
        @model <>
          ~S"""
          props = Map.new(0..999, &{"p#{&1}", %{"type" => "integer"}})
          schema = %{"type" => "object", "properties" => props, "required" => Map.keys(props)}
          LlamaCppEx.generate(model, "JSON:", json_schema: schema, max_tokens: 8, temp: 0.0)
          """

      assert %{value: {:ok, text}} = child!(body, max_ms: 30_000)
      assert String.starts_with?(text, "{")
    end

    test "3. a template nesting a list 100k deep and calling tojson" do
      tpl =
        "{% set ns = namespace(x=[]) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}" <>
          "{% endfor %}{{ ns.x|tojson|length }}"

      assert %{value: {:error, msg}} = child!(render_template(tpl))
      assert msg =~ "chat template"
    end

    for {name, tpl} <- [
          {"doubling a string 40 times",
           "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}"},
          {"a 10 GB format width", "{{ '%09999999999d'|format(1) }}"},
          {"a 1 GB format width", "{{ '%0999999999d'|format(1) }}"},
          {"a lazy 10^8 repeat", "{{ 'a' ~ (['x'] * 100000000)|join }}"},
          {"a 10^9 character string repeat", "{{ ('x' * 1000000000)|length }}"}
        ] do
      test "4. a template allocating without bound: #{name}" do
        assert %{value: {:error, msg}} = child!(render_template(unquote(tpl)))
        assert msg =~ "chat template"
      end
    end

    test "5. bad request options neither stop the Server nor disturb a concurrent stream; " <>
           "the model route answers each with an error" do
      body = ~S"""
      import Bitwise
      {:ok, server} =
        LlamaCppEx.Server.start_link(model_path: LlamaCppEx.TestModels.smollm2_path(), n_parallel: 2, temp: 0.0)
      {:ok, model} = LlamaCppEx.TestModels.wait_model(server)

      bad = [
        top_k: 1 <<< 64, seed: 1 <<< 64, penalty_last_n: 1 <<< 64, min_keep: 1 <<< 64,
        temp: 1 <<< 2000,
        mirostat_tau: 1 <<< 2000, logit_bias: %{(1 <<< 64) => 1.0}, grammar: <<0xFF>>,
        grammar: 123, dry_sequence_breakers: [<<0xFF>>]
      ]

      # a long stream served while the bad requests arrive
      reference = LlamaCppEx.Server.generate(server, "Count from one to fifty:", max_tokens: 96)
      stream_task = Task.async(fn ->
        server |> LlamaCppEx.Server.stream("Count from one to fifty:", max_tokens: 96) |> Enum.join()
      end)

      answer = fn f ->
        try do
          f.()
        rescue
          e in ArgumentError -> {:argument_error, Exception.message(e)}
          e -> {:other_exception, e.__struct__, Exception.message(e)}
        end
      end

      pid = server
      results =
        for {k, v} <- bad do
          opts = [{k, v}, max_tokens: 4]
          {k,
           answer.(fn -> LlamaCppEx.Server.generate(server, "Hi", opts) end),
           answer.(fn -> server |> LlamaCppEx.Server.stream("Hi", opts) |> Enum.to_list() end),
           answer.(fn -> LlamaCppEx.generate(model, "Hi", opts) end)}
        end

      streamed = Task.await(stream_task, 60_000)
      %{results: results, alive: Process.alive?(pid), streamed: streamed, reference: reference,
        after: LlamaCppEx.Server.generate(server, "Hi", max_tokens: 2)}
      """

      assert %{value: v} = child!(body, max_ms: 60_000)
      assert v.alive
      assert {:ok, ref_text} = v.reference
      assert v.streamed == ref_text
      assert {:ok, _} = v.after

      for {key, server_call, server_stream, model_call} <- v.results do
        for {route, r} <- [server: server_call, stream: server_stream, model: model_call] do
          ok? =
            match?({:error, _}, r) or match?({:argument_error, _}, r) or
              match?([{:error, _}], r)

          assert ok?, "#{key} on #{route}: #{inspect(r)}"
        end
      end
    end
  end

  describe "hangs and unbounded work (cases 6-10)" do
    test "6. n_threads beyond the cap is an error at once and does not leak into other contexts" do
      body =
        @model <>
          ~S"""
          big = for n <- [32, 64, 1000], do: LlamaCppEx.generate(model, "Hi", max_tokens: 2, n_threads: n)
          cap = 2 * System.schedulers_online()
          {:ok, _} = LlamaCppEx.generate(model, "Hi", max_tokens: 2, n_threads: cap)
          {t, {:ok, _}} = :timer.tc(fn -> LlamaCppEx.generate(model, "Hi", max_tokens: 2) end)
          big ++ [div(t, 1000)]
          """

      assert %{value: [a, b, c, default_ms]} = child!(body)

      for r <- [a, b, c] do
        assert match?({:error, _}, r) or match?({:argument_error, _}, r), inspect(r)
      end

      # a default call after the others runs at its usual speed (tens of ms)
      assert default_ms < 2_000
    end

    test "7. a 2 MB prompt and 1 MB of chat content are errors before any evaluation" do
      body =
        @model <>
          ~S"""
          big = String.duplicate("hello world ", 175_000)
          chat = [%{role: "user", content: String.duplicate("lorem ipsum ", 90_000)}]
          {t1, r1} = :timer.tc(fn -> LlamaCppEx.generate(model, big, max_tokens: 2) end)
          {t2, r2} = :timer.tc(fn -> LlamaCppEx.chat(model, chat, max_tokens: 2) end)
          {t3, r3} = :timer.tc(fn -> model |> LlamaCppEx.stream(big, max_tokens: 2) |> Enum.to_list() end)
          %{generate: {div(t1, 1000), r1}, chat: {div(t2, 1000), r2}, stream: {div(t3, 1000), r3}}
          """

      assert %{value: v} = child!(body, max_ms: 20_000)
      assert {ms1, {:error, _}} = v.generate
      assert {ms2, {:error, _}} = v.chat
      assert {ms3, [{:error, _}]} = v.stream
      assert ms1 < 8_000 and ms2 < 8_000 and ms3 < 8_000, inspect({ms1, ms2, ms3})
    end

    test "7. a caller that dies mid-prompt stops the evaluation within a step" do
      body =
        @model <>
          ~S"""
          # 6000 tokens of prompt: many prefill steps
          prompt = String.duplicate("the quick brown fox jumps over the lazy dog ", 600)
          pid = spawn(fn -> LlamaCppEx.generate(model, prompt, max_tokens: 1, n_ctx: 8192) end)
          Process.sleep(300)
          Process.exit(pid, :kill)
          t0 = System.monotonic_time(:millisecond)
          # the workers are free again: a short generate is not queued behind the dead prefill
          {:ok, _} = LlamaCppEx.generate(model, "Hi", max_tokens: 1, temp: 0.0)
          System.monotonic_time(:millisecond) - t0
          """

      assert %{value: ms} = child!(body, max_ms: 30_000)
      # a whole 6000-token prefill takes several seconds on two cores; one step far less
      assert ms < 3_000
    end

    test "8. nested range loops in a template hit the step limit" do
      tpl = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
      assert %{value: {:error, msg}} = child!(render_template(tpl))
      assert msg =~ "chat template"
    end

    test "9. a Server that dies ends its streams with {:error, :server_down} within a second" do
      body = ~S"""
      {:ok, server} =
        LlamaCppEx.Server.start_link(model_path: LlamaCppEx.TestModels.smollm2_path(), n_parallel: 2)
      Process.unlink(server)
      {:ok, _} = LlamaCppEx.TestModels.wait_model(server)
      parent = self()

      task = Task.async(fn ->
        server
        |> LlamaCppEx.Server.stream("Count from one to five hundred:", max_tokens: 2000, temp: 0.0, timeout: 30_000)
        |> Enum.reduce(0, fn
          {:error, reason}, n -> send(parent, {:ended, reason, System.monotonic_time(:millisecond)}); n
          _chunk, n -> if n == 0, do: send(parent, :streaming); n + 1
        end)
        send(parent, {:ended, :normally, System.monotonic_time(:millisecond)})
      end)

      receive do :streaming -> :ok after 20_000 -> raise "no tokens" end
      killed_at = System.monotonic_time(:millisecond)
      Process.exit(server, :kill)

      receive do
        {:ended, reason, at} -> Task.await(task); {reason, at - killed_at}
      after 5_000 -> :no_end
      end
      """

      assert %{value: {:server_down, ms}} = child!(body, max_ms: 40_000)
      assert ms < 1_000
    end

    test "10. a 10k-optional-property schema and a 1 MB GBNF are rejected fast" do
      body =
        @model <>
          ~S"""
          props = Map.new(0..9_999, &{"p#{&1}", %{"type" => "integer"}})
          schema = %{"type" => "object", "properties" => props}
          gbnf = "root ::= " <> Enum.map_join(1..100_000, " | ", &~s("w#{&1}"))
          {t1, r1} = :timer.tc(fn -> LlamaCppEx.Grammar.from_json_schema(schema) end)
          {t2, r2} = :timer.tc(fn -> LlamaCppEx.Grammar.check(model, gbnf) end)
          {t3, r3} = :timer.tc(fn ->
            try do
              LlamaCppEx.generate(model, "x", json_schema: schema, max_tokens: 2)
            rescue
              e in ArgumentError -> {:argument_error, Exception.message(e)}
            end
          end)
          %{schema: {div(t1, 1000), r1}, gbnf: {byte_size(gbnf), div(t2, 1000), r2},
            generate: {div(t3, 1000), r3}}
          """

      assert %{value: v} = child!(body, max_ms: 20_000)
      assert {ms1, {:error, m1}} = v.schema
      assert m1 =~ "too"
      assert {size, ms2, {:error, _}} = v.gbnf
      assert size > 1_000_000
      assert {ms3, {:argument_error, _}} = v.generate
      assert ms1 < 3_000 and ms2 < 3_000 and ms3 < 3_000, inspect(v)
    end
  end

  describe "smaller defects" do
    test "sampler, chat and context inputs that were accepted or raised" do
      body =
        @model <>
          ~S"""
          import Bitwise
          {:ok, s} = LlamaCppEx.Sampler.create(model, temp: 0.0)
          n_vocab = LlamaCppEx.Tokenizer.vocab_size(model)
          every = Map.new(0..(n_vocab - 1), &{&1, :neg_infinity})
          chat = fn msgs, opts -> LlamaCppEx.Chat.apply_template(model, msgs, opts) end
          {:ok, ctx} = LlamaCppEx.Context.create(model, n_ctx: 64)

          %{
            accept:
              for id <- [n_vocab, (1 <<< 32) - 1] do
                try do
                  LlamaCppEx.Sampler.accept(s, id)
                rescue
                  e in ArgumentError -> {:argument_error, Exception.message(e)}
                end
              end,
            ban_all: LlamaCppEx.Sampler.create(model, logit_bias: every),
            chat: [
              chat.([%{role: %{a: 1}, content: "x"}], []),
              chat.([%{role: "user", content: [%{"type" => "text", "text" => "hi"}]}], []),
              chat.([%{role: "user", content: %{a: 1}}], []),
              chat.([%{role: "user", content: <<0xFF, 0xFE>>}], []),
              chat.([%{role: "user", content: "hi"}], chat_template_kwargs: %{"messages" => []})
            ],
            nothing: [
              LlamaCppEx.Grammar.check(model, "root ::= root"),
              LlamaCppEx.generate(model, "x", grammar: "root ::= root", max_tokens: 2),
              (try do
                 LlamaCppEx.generate(model, "x", json_schema: %{"$ref" => "#"}, max_tokens: 2)
               rescue
                 e in ArgumentError -> {:argument_error, Exception.message(e)}
               end)
            ],
            decode65: LlamaCppEx.Context.decode(ctx, List.duplicate(42, 65)),
            decode64: LlamaCppEx.Context.decode(ctx, List.duplicate(42, 64))
          }
          """

      assert %{value: v} = child!(body)
      assert [{:argument_error, m1}, {:argument_error, m2}] = v.accept
      assert m1 =~ "invalid token id 49152"
      assert m2 =~ "invalid token id"
      assert {:error, msg} = v.ban_all
      assert msg =~ "bans every token"

      [map_role, list_content, map_content, bad_utf8, kw_messages] = v.chat
      assert {:error, _} = map_role
      # structured content (a list of parts) reaches the template, which cannot add it to a
      # string: the template's error, as a value
      assert {:error, "chat template failed: invalid operation" <> _} = list_content
      assert {:error, _} = map_content
      assert {:error, _} = bad_utf8
      assert {:error, kw} = kw_messages
      assert kw =~ "messages"

      for r <- v.nothing do
        assert match?({:error, _}, r) or match?({:argument_error, _}, r), inspect(r)
      end

      assert {:error, _} = v.decode65
      assert :ok = v.decode64
    end

    test "GGUF headers with a 2^62 string length or no architecture have clear messages" do
      body = ~S"""
      import Bitwise
      dir = System.tmp_dir!()
      long = Path.join(dir, "hostile_len_#{System.unique_integer([:positive])}.gguf")
      File.write!(long, "GGUF" <> <<3::little-32, 0::little-64, 1::little-64, 1 <<< 62::little-64>> <> :binary.copy("a", 200))
      empty = Path.join(dir, "hostile_arch_#{System.unique_integer([:positive])}.gguf")
      LlamaCppEx.GgufWriter.write!(empty, [{"general.architecture", {:string, ""}}])
      r = {LlamaCppEx.Model.load(long), LlamaCppEx.Model.load(empty)}
      File.rm!(long)
      File.rm!(empty)
      r
      """

      assert %{value: {{:error, long}, {:error, arch}}} = child!(body)
      assert long =~ "length 4611686018427387904"
      assert long =~ "exceeds"
      assert arch =~ "names no architecture"
    end
  end

  describe "damaged model files" do
    test "bit flips in the metadata and tensor directory of a real GGUF load or fail, never crash" do
      # Copies SmolLM2 once and flips bytes in place (restoring each) within the first
      # 1.5 MB: the header, the tokenizer arrays and the tensor directory.
      body =
        @model <>
          ~S"""
          src = LlamaCppEx.TestModels.smollm2_path()
          path = Path.join(System.tmp_dir!(), "hostile_flip_#{System.unique_integer([:positive])}.gguf")
          File.cp!(src, path)
          :rand.seed(:exsss, {13, 14, 15})
          {:ok, fd} = :file.open(path, [:read, :write, :binary, :raw])

          outcomes =
            for i <- 1..160 do
              # the first 100 in the first 64 KiB (header, early metadata), the rest anywhere
              offset = if i <= 100, do: :rand.uniform(65_536) - 1, else: :rand.uniform(1_500_000) - 1
              {:ok, <<old>>} = :file.pread(fd, offset, 1)
              new = Bitwise.bxor(old, Bitwise.bsl(1, :rand.uniform(8) - 1))
              :ok = :file.pwrite(fd, offset, <<new>>)
              r =
                case LlamaCppEx.Model.load(path) do
                  {:ok, m} ->
                    case LlamaCppEx.generate(m, "Hi", max_tokens: 2, temp: 0.0) do
                      {:ok, _} -> :loaded
                      {:error, _} -> :loaded_generate_error
                    end
                  {:error, msg} when is_binary(msg) -> :error
                end
              :ok = :file.pwrite(fd, offset, <<old>>)
              r
            end

          :file.close(fd)
          File.rm!(path)
          {:ok, _} = LlamaCppEx.generate(model, "Hi", max_tokens: 2)
          Enum.frequencies(outcomes)
          """

      assert %{value: freq} = child!(body, max_ms: 240_000, limit_ms: 300_000)
      assert Enum.sum(Map.values(freq)) == 160
      assert Map.get(freq, :error, 0) > 0, inspect(freq)
      IO.puts("bit flips: #{inspect(freq)}")
    end

    test "truncated copies of a real GGUF fail with an error" do
      body = ~S"""
      src = LlamaCppEx.TestModels.smollm2_path()
      size = File.stat!(src).size
      {:ok, fd} = :file.open(src, [:read, :binary, :raw])
      path = Path.join(System.tmp_dir!(), "hostile_trunc_#{System.unique_integer([:positive])}.gguf")
      :rand.seed(:exsss, {1, 2, 3})
      offsets = Enum.map(1..40, fn _ -> :rand.uniform(2_000_000) end) ++ Enum.map(1..10, &div(size * &1, 11))

      results =
        for offset <- offsets do
          {:ok, data} = :file.pread(fd, 0, offset)
          File.write!(path, data)
          {offset, LlamaCppEx.Model.load(path)}
        end

      File.rm!(path)
      Enum.reject(results, fn {_, r} -> match?({:error, m} when is_binary(m), r) end)
      """

      assert %{value: []} = child!(body, max_ms: 60_000)
    end
  end
end
