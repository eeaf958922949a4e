defmodule LlamaCppEx.RegressionsTest do
  @moduledoc """
  Defects found by using the library as a new user would (issue "Server and NIF redesign"),
  each pinned by a test that failed before the fix.
  """
  use ExUnit.Case, async: false

  import ExUnit.CaptureLog
  alias LlamaCppEx.{Context, Grammar, JSON, Model, Options, Server, TestModels}

  @moduletag timeout: 300_000

  setup_all do
    model = TestModels.smollm2()

    {:ok, server} =
      Server.start_link(
        model_path: TestModels.smollm2_path(),
        n_parallel: 2,
        n_ctx: 4096,
        temp: 0.0
      )

    Process.unlink(server)
    {:ok, _} = TestModels.wait_model(server)
    on_exit(fn -> if Process.alive?(server), do: GenServer.stop(server) end)
    %{model: model, server: server}
  end

  test "1. stream/3 with logprobs: true yields the same text as without", %{model: model} do
    opts = [max_tokens: 12, temp: 0.0]
    plain = model |> LlamaCppEx.stream("The capital of France is", opts) |> Enum.join()

    with_lp =
      model
      |> LlamaCppEx.stream("The capital of France is", [logprobs: true] ++ opts)
      |> Enum.join()

    assert plain != ""
    assert with_lp == plain

    top =
      model
      |> LlamaCppEx.stream("The capital of France is", [top_logprobs: 3] ++ opts)
      |> Enum.join()

    assert top == plain
  end

  test "2. a timed-out server stream_chat_completion frees its slot and stops generating",
       %{server: server} do
    Server.reset_stats_window(server)
    msgs = [%{role: "user", content: "Write a long story about a dragon and a knight."}]

    elements =
      server
      |> LlamaCppEx.stream_chat_completion(msgs, max_tokens: 400, timeout: 1, cache_prompt: false)
      |> Enum.to_list()

    assert List.last(elements) == {:error, :timeout}
    # cancelled within one tick
    Process.sleep(300)
    assert %{active_slots: 0, queue_depth: 0, tokens_generated: before} = Server.get_stats(server)
    Process.sleep(500)
    assert %{tokens_generated: ^before} = Server.get_stats(server)
    assert before < 400
  end

  test "2. every way of giving up frees the slot", %{server: server} do
    # a halted stream
    assert [_] = server |> Server.stream("Tell me a story", max_tokens: 300) |> Enum.take(1)
    # a blocking call that times out (exits, as a GenServer.call would)
    assert {:timeout, _} =
             catch_exit(Server.generate(server, "Tell me a story", max_tokens: 300, timeout: 1))

    # a caller that dies
    pid = spawn(fn -> Server.generate(server, "Tell me a story", max_tokens: 300) end)
    Process.sleep(100)
    Process.exit(pid, :kill)
    Process.sleep(300)
    assert %{active_slots: 0, queue_depth: 0} = Server.get_stats(server)
  end

  test "3. a JSON Schema without additionalProperties forbids other keys on every route",
       %{model: model} do
    schema = %{
      "type" => "object",
      "properties" => %{"capital" => %{"type" => "string", "maxLength" => 20}},
      "required" => ["capital"]
    }

    # prompts that ask for more keys than the schema lists (SmolLM2 added them before)
    for prompt <- [
          "Give me a JSON object about Japan with keys capital, population and area:",
          "JSON with fields capital, population, language for Germany:"
        ] do
      {:ok, text} =
        LlamaCppEx.generate(model, prompt, json_schema: schema, max_tokens: 60, temp: 0.0)

      assert {:ok, %{"capital" => _} = decoded} = JSON.decode(text)
      assert Map.keys(decoded) == ["capital"]
    end

    prompt = "JSON with fields capital, population, language for Germany:"

    {:ok, gbnf} = Grammar.from_json_schema(schema)
    refute gbnf =~ "additional"

    # extras stay possible when the schema says so
    open = Map.put(schema, "additionalProperties", true)

    assert {:ok, _} =
             LlamaCppEx.generate(model, prompt, json_schema: open, max_tokens: 8, temp: 0.0)
  end

  test "4. KV cache types: q8_0/q4_0 are real quantized caches; the rest is an error, never a silent f16",
       %{model: model} do
    assert {:error, msg} = Context.create(model, type_k: :q5_1)
    assert msg =~ "unsupported KV cache type :q5_1 (supported: :f16, :f32, :q8_0, :q4_0)"
    assert {:error, msg} = Context.create(model, type_v: :bf16)
    assert msg =~ "unsupported KV cache type :bf16"
    assert {:error, _} = Context.create(model, type_k: :q9)
    assert {:error, _} = Context.create(model, rope_freq_base: 20_000.0)
    assert {:ok, _} = Context.create(model, type_k: :f32, type_v: :f32, flash_attn: :enabled)
    assert {:ok, _} = Context.create(model, type_k: :q8_0, type_v: :f16)
    assert {:error, {:load_failed, msg}} = start_and_wait(type_k: :q5_1)
    assert msg =~ "unsupported KV cache type"

    # a q8_0 cache (keys and values) on the model route and in a server
    prompt = "The capital of France is"
    {:ok, want} = LlamaCppEx.generate(model, prompt, max_tokens: 12, temp: 0.0)

    assert {:ok, ^want} =
             LlamaCppEx.generate(model, prompt,
               max_tokens: 12,
               temp: 0.0,
               type_k: :q8_0,
               type_v: :q8_0
             )

    {:ok, s} =
      Server.start_link(
        model_path: TestModels.smollm2_path(),
        n_ctx: 512,
        type_k: :q8_0,
        type_v: :q8_0
      )

    {:ok, _} = TestModels.wait_model(s)
    assert {:ok, ^want} = Server.generate(s, prompt, max_tokens: 12, temp: 0.0)
    GenServer.stop(s)
  end

  test "a KV budget in bytes holds more tokens in quantized caches" do
    n_ctx =
      for type <- [:f16, :q8_0, :q4_0] do
        {s, _} =
          TestModels.start_server(kv_budget_mb: 4, n_parallel: 2, type_k: type, type_v: type)

        %{n_ctx: n} = Server.get_stats(s)
        if type == :q4_0, do: assert({:ok, _} = Server.generate(s, "Hello", max_tokens: 4))
        GenServer.stop(s)
        n
      end

    # SmolLM2: 30 layers x 3 KV heads x 64, keys and values: 23040 bytes per token in f16
    assert n_ctx == [
             div(4 * 1_048_576, 23_040),
             div(4 * 1_048_576, 12_240),
             div(4 * 1_048_576, 6_480)
           ]

    [f16, q8, q4] = n_ctx
    assert q8 / f16 > 1.85 and q4 / f16 > 3.5
  end

  defp start_and_wait(opts) do
    Process.flag(:trap_exit, true)
    {:ok, pid} = Server.start_link([model_path: TestModels.smollm2_path()] ++ opts)
    assert_receive {:EXIT, ^pid, reason}, 30_000
    {:error, reason}
  end

  test "5. the prefix-instability warning is logged once per server" do
    {:ok, server} =
      Server.start_link(
        model_path: TestModels.smollm2_path(),
        n_parallel: 1,
        n_ctx: 4096,
        temp: 0.0
      )

    {:ok, _} = TestModels.wait_model(server)
    long = Enum.to_list(1000..1099)

    log =
      capture_log(fn ->
        for round <- 1..3 do
          {:ok, _} = Server.generate_tokens(server, long, max_tokens: 1)
          # shares 20 of the 101 cached tokens, then diverges
          diverging =
            Enum.take(long, 20) ++ Enum.to_list((2000 + round * 100)..(2000 + round * 100 + 80))

          {:ok, _} = Server.generate_tokens(server, diverging, max_tokens: 1)
        end
      end)

    assert length(String.split(log, "rewriting earlier turns")) - 1 == 1
    GenServer.stop(server)
  end

  describe "contract details" do
    test "the unknown-option message puts the known options on a line of their own" do
      err =
        assert_raise ArgumentError, fn -> Options.validate!([tempp: 1], [:temp, :top_k], "x") end

      assert [first, "Known options: :temp, :top_k"] = String.split(err.message, "\n")
      assert first =~ "did you mean :temp?"
    end

    test "encode_split_mode/1 raises ArgumentError for any bad value" do
      for bad <- [:diagonal, "layer", 1, nil] do
        assert_raise ArgumentError, ~r/unknown split_mode/, fn -> Model.encode_split_mode(bad) end
      end

      assert Model.encode_split_mode(:row) == 2
    end

    test "Server.init/1 validates its options like start_link/1" do
      assert_raise ArgumentError, ~r/n_paralell \(did you mean :n_parallel\?\)/, fn ->
        Server.init(model_path: TestModels.smollm2_path(), n_paralell: 2)
      end

      assert {:stop, {:missing_option, :model_path}} = Server.init([])
    end
  end
end
