defmodule LlamaCppEx.ServerTest do
  use ExUnit.Case, async: false

  alias LlamaCppEx.{Server, TestModels, Tokenizer}

  @moduletag timeout: 600_000

  setup_all do
    path = TestModels.smollm2_path()
    {:ok, server} = Server.start_link(model_path: path, n_parallel: 4, n_ctx: 4096, temp: 0.0)
    # Unlink so a failing test cannot take the shared server down with it.
    Process.unlink(server)
    {:ok, model} = wait_model(server)
    %{server: server, model: model, path: path}
  end

  defp wait_model(server) do
    case Server.fetch_model(server) do
      {:ok, model} -> {:ok, model}
      {:error, :not_ready} -> wait_model(server)
      other -> other
    end
  end

  defp attach(events), do: TestModels.attach_telemetry(events)

  defp assert_no_leaks(server) do
    {:ok, audit} = Server.kv_audit(server)
    [owners] = audit.owners

    for {seq, blocks} <- owners do
      cached = audit.cached_tokens[seq]
      assert cached > 0, "seq #{seq} holds #{blocks} blocks but caches nothing"
      assert blocks == div(cached + 15, 16), "seq #{seq}: #{blocks} blocks for #{cached} tokens"
    end

    # every position the cache holds is one the server lists
    for {seq, cached} <- audit.cached_tokens,
        do: assert(Map.get(audit.tokens, seq, 0) == cached, "seq #{seq}: #{inspect(audit)}")

    audit
  end

  describe "start_link/1 validation" do
    test "synchronous errors" do
      Process.flag(:trap_exit, true)
      assert {:error, {:missing_option, :model_path}} = Server.start_link([])
      assert {:error, {:invalid_model_path, 42}} = Server.start_link(model_path: 42)

      assert {:error, {:model_not_found, "/nope.gguf"}} =
               Server.start_link(model_path: "/nope.gguf")

      path = TestModels.smollm2_path()

      assert {:error, {:invalid_batch_strategy, "x"}} =
               Server.start_link(model_path: path, batch_strategy: "x")

      assert {:error, {:invalid_batch_strategy, {:module_not_available, NoSuchStrategy}}} =
               Server.start_link(model_path: path, batch_strategy: NoSuchStrategy)

      assert {:error, {:invalid_batch_strategy, {:build_batch_4_not_exported, String}}} =
               Server.start_link(model_path: path, batch_strategy: String)

      assert {:error, "invalid overlap: :yes"} =
               Server.start_link(model_path: path, overlap: :yes)

      assert_raise ArgumentError, ~r/n_paralell \(did you mean :n_parallel\?\)/, fn ->
        Server.start_link(model_path: path, n_paralell: 2)
      end

      assert_raise ArgumentError, ~r/vocab_only/, fn ->
        Server.start_link(model_path: path, vocab_only: true)
      end
    end

    @tag :tmp_dir
    test "a file that is not a model stops the server with {:load_failed, _}", %{tmp_dir: dir} do
      Process.flag(:trap_exit, true)
      path = Path.join(dir, "bad.gguf")
      File.write!(path, "not a gguf")
      {:ok, pid} = Server.start_link(model_path: path)
      assert_receive {:EXIT, ^pid, {:load_failed, msg}}, 10_000
      assert msg =~ "failed to load model"
      assert {:error, :noproc} = Server.fetch_model(pid)
      assert_raise ArgumentError, ~r/no model available/, fn -> Server.get_model(pid) end
    end
  end

  test "generate, stream and complete_tokens", %{server: server, model: model} do
    assert {:ok, text} = Server.generate(server, "The capital of France is", max_tokens: 12)
    assert text =~ "Paris"
    assert Enum.join(Server.stream(server, "The capital of France is", max_tokens: 12)) == text
    {:ok, ids} = Tokenizer.encode(model, "The capital of France is")
    assert {:ok, ^text} = Server.generate_tokens(server, ids, max_tokens: 12)

    assert {:ok, %{text: ^text, completion_tokens: 12, finish_reason: :max_tokens}} =
             Server.complete_tokens(server, ids, max_tokens: 12)

    assert {:error, :empty_prompt} = Server.generate_tokens(server, [], max_tokens: 4)

    assert [{:error, :empty_prompt}] =
             Enum.to_list(Server.stream_tokens(server, [], max_tokens: 4))

    assert {:error, :invalid_token} =
             Server.generate_tokens(server, [1, 10_000_000], max_tokens: 4)

    assert_raise ArgumentError, ~r/unknown option: :n_ctx/, fn ->
      Server.generate(server, "x", n_ctx: 10)
    end

    chat =
      "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face" <>
        "<|im_end|>\n<|im_start|>user\nName the capital of France.<|im_end|>\n<|im_start|>assistant\n"

    {:ok, chat_ids} = Tokenizer.encode(model, chat)

    assert {:ok, %{finish_reason: :eog, text: answer, completion_tokens: n}} =
             Server.complete_tokens(server, chat_ids, max_tokens: 200)

    assert answer =~ "Paris"
    assert n < 200
  end

  test "16 concurrent streams on 4 slots equal the same requests run one at a time", %{
    server: server
  } do
    prompts = for i <- 1..16, do: "Fact #{i}: the number #{i * 7} is"
    sequential = for p <- prompts, do: Server.generate(server, p, max_tokens: 20)

    concurrent =
      prompts
      |> Task.async_stream(fn p -> Server.stream(server, p, max_tokens: 20) |> Enum.join() end,
        max_concurrency: 16,
        timeout: 120_000
      )
      |> Enum.map(fn {:ok, text} -> {:ok, text} end)

    assert concurrent == sequential
    assert_no_leaks(server)
  end

  test "a seeded request samples the same text whatever else is in the batch", %{server: server} do
    opts = [max_tokens: 24, temp: 0.9, seed: 77]
    {:ok, alone} = Server.generate(server, "Once upon a time", opts)

    others =
      for i <- 1..3 do
        Task.async(fn ->
          Server.generate(server, "Noise #{i}: the weather today",
            max_tokens: 30,
            temp: 1.0,
            seed: i
          )
        end)
      end

    {:ok, busy} = Server.generate(server, "Once upon a time", opts)
    Enum.each(others, &Task.await(&1, 60_000))
    assert busy == alone
  end

  test "prefix sharing across slots", %{server: server, model: model} do
    attach([[:llama_cpp_ex, :server, :request, :start]])
    shared = String.duplicate("The quick brown fox jumps over the lazy dog. ", 20)
    {:ok, ids} = Tokenizer.encode(model, shared)
    assert length(ids) >= 200
    {:ok, q1} = Tokenizer.encode(model, shared <> "Question one?")
    {:ok, q2} = Tokenizer.encode(model, shared <> "Question two, different?")

    # q1 keeps generating in its slot while q2 arrives: q2 lands in another slot and shares
    # q1's blocks instead of evaluating the common prefix again.
    ref = make_ref()
    :ok = Server.subscribe_stream_tokens(server, q1, ref, max_tokens: 60)
    assert_receive {^ref, {:token, _}}, 30_000
    assert_receive {:telemetry, _, %{prefix_cache_tokens: _}, %{seq_id: seq1}}, 1_000
    {:ok, _} = Server.generate_tokens(server, q2, max_tokens: 4)
    assert_receive {:telemetry, _, %{prefix_cache_tokens: shared_tokens}, %{seq_id: seq2}}, 1_000
    assert seq2 != seq1
    assert shared_tokens >= length(ids) - 1
    Server.cancel(server, ref)

    # the same prompt again reuses everything but its last token
    {:ok, _} = Server.generate_tokens(server, q2, max_tokens: 4)
    assert_receive {:telemetry, _, %{prefix_cache_tokens: n}, _}, 1_000
    assert n == length(q2) - 1

    # cache_prompt: false and another scope share nothing
    {:ok, _} = Server.generate_tokens(server, q2, max_tokens: 2, cache_prompt: false)
    assert_receive {:telemetry, _, %{prefix_cache_tokens: 0}, _}, 1_000
    {:ok, _} = Server.generate_tokens(server, q2, max_tokens: 2, cache_scope: "tenant-b")
    assert_receive {:telemetry, _, %{prefix_cache_tokens: 0}, _}, 1_000
    assert_no_leaks(server)
  end

  test "Enum.take/2 and dead callers free their slots", %{server: server} do
    attach([[:llama_cpp_ex, :server, :request, :done]])

    assert [_, _, _] =
             server |> Server.stream("Once upon a time", max_tokens: 400) |> Enum.take(3)

    assert_receive {:telemetry, _, %{generated_tokens: n}, %{stop_reason: :cancelled}}, 10_000
    assert n < 50

    pid = spawn(fn -> Server.generate(server, "1, 2, 3, 4, 5, 6,", max_tokens: 400) end)
    Process.sleep(100)
    Process.exit(pid, :kill)
    assert_receive {:telemetry, _, %{generated_tokens: n}, %{stop_reason: :cancelled}}, 10_000
    assert n < 400
    assert %{active_slots: 0, queue_depth: 0} = Server.get_stats(server)
  end

  test "a stream timeout gives {:error, :timeout} and cancels", %{server: server} do
    # paused, the server evaluates nothing: no token can arrive before the timeout, however
    # fast the machine
    :ok = Server.pause(server)

    assert [{:error, :timeout}] =
             server |> Server.stream("Hello there", max_tokens: 200, timeout: 1) |> Enum.to_list()

    assert %{active_slots: 0, queue_depth: 0} = Server.get_stats(server)

    # a blocking call that times out exits, and its request does not keep running
    assert {:timeout, _} =
             catch_exit(Server.generate(server, "Hello again", max_tokens: 300, timeout: 1))

    assert %{active_slots: 0, queue_depth: 0} = Server.get_stats(server)
    :ok = Server.resume(server)
    assert {:ok, _} = Server.generate(server, "Hello", max_tokens: 2)
  end

  test "get_stats answers during a forward pass", %{server: server} do
    ref = make_ref()
    long = String.duplicate("Some long prompt text to prefill. ", 120)
    {:ok, ids} = Tokenizer.encode(Server.get_model(server), long)
    :ok = Server.subscribe_stream_tokens(server, ids, ref, max_tokens: 4, cache_prompt: false)
    stats = Server.get_stats(server)
    assert stats.active_slots + stats.queue_depth == 1
    assert_receive {^ref, {:done, :max_tokens}}, 60_000
    Server.reset_stats_window(server)
    assert %{window_tokens: 0, tokens_generated: total} = Server.get_stats(server)
    assert total > 0
  end

  test "200 requests with random early halts and killed callers leak nothing", %{server: server} do
    :rand.seed(:exsss, {1, 2, 3})
    before = Server.get_stats(server)

    1..200
    |> Task.async_stream(
      fn i ->
        prompt = "Request #{i}: tell me about #{Enum.random(~w(cats dogs rivers stars trains))}"

        case rem(i, 4) do
          0 ->
            server |> Server.stream(prompt, max_tokens: 12) |> Enum.take(Enum.random(1..4))

          1 ->
            Server.generate(server, prompt, max_tokens: 6, cache_prompt: rem(i, 8) == 1)

          2 ->
            pid = spawn(fn -> Server.generate(server, prompt, max_tokens: 40) end)
            Process.sleep(Enum.random(0..30))
            Process.exit(pid, :kill)

          3 ->
            server |> Server.stream(prompt, max_tokens: 8, temp: 0.8, seed: i) |> Enum.to_list()
        end
      end,
      max_concurrency: 12,
      timeout: 120_000
    )
    |> Stream.run()

    assert Process.alive?(server)
    Process.sleep(100)
    stats = Server.get_stats(server)
    assert %{active_slots: 0, queue_depth: 0, idle_slots: 4} = stats
    assert stats.requests_completed >= before.requests_completed + 150
    assert_no_leaks(server)
  end

  describe ":overlap" do
    test "queued steps generate what planned ticks do; the cache stays what the slots list",
         %{path: path, model: model} do
      attach([[:llama_cpp_ex, :server, :tick]])

      requests =
        for {prompt, opts} <- [
              {"The capital of France is", max_tokens: 24},
              {"Once upon a time", max_tokens: 7},
              {"1, 2, 3, 4,", max_tokens: 30, stop: ["9"]},
              {"The days of the week are Monday, Tuesday,", max_tokens: 30, stop: [" Friday"]}
            ] do
          {:ok, ids} = Tokenizer.encode(model, prompt)
          {ids, opts}
        end

      run = fn overlap ->
        s = start_ready!(path, n_ctx: 2048, overlap: overlap)

        # twice: the second wave starts from the caches the first one left
        results =
          for _ <- 1..2 do
            requests
            |> Enum.map(fn {ids, opts} ->
              Task.async(fn -> Server.complete_tokens(s, ids, opts) end)
            end)
            |> Task.await_many(120_000)
          end

        assert_no_leaks(s)
        GenServer.stop(s)
        {results, queued_ticks(s, 0)}
      end

      {overlapped, queued} = run.(true)
      {planned, 0} = run.(false)
      assert overlapped == planned
      assert queued > 0

      reasons = for {:ok, r} <- List.flatten(planned), do: r.finish_reason
      assert Enum.count(reasons, &(&1 == :stop)) == 4
      assert Enum.count(reasons, &(&1 == :max_tokens)) == 4
    end
  end

  describe ":overlap under pressure" do
    test "with evictions, failures, halts and the RAM prompt cache, what completes matches",
         %{path: path} do
      prompts =
        for i <- 1..12,
            do: "Note #{rem(i, 5)}: " <> String.duplicate("the river runs down to the sea, ", 6)

      run = fn overlap ->
        s = start_ready!(path, n_ctx: 256, prompt_cache_ram_mb: 16, overlap: overlap)

        results =
          prompts
          |> Enum.with_index()
          |> Task.async_stream(
            fn {p, i} ->
              case rem(i, 4) do
                0 -> Server.generate(s, p, max_tokens: 40, stop: [" sea,"])
                3 -> {:halted, s |> Server.stream(p, max_tokens: 30) |> Enum.take(2)}
                _ -> Server.generate(s, p, max_tokens: 40 + 2 * i)
              end
            end,
            max_concurrency: 6,
            timeout: 120_000
          )
          |> Enum.map(fn {:ok, r} -> r end)

        assert_no_leaks(s)
        GenServer.stop(s)
        results
      end

      attach([[:llama_cpp_ex, :server, :kv_pressure], [:llama_cpp_ex, :server, :ram_cache]])
      overlapped = run.(true)
      planned = run.(false)
      IO.inspect({overlapped, planned}, limit: :infinity)

      IO.inspect(
        Process.info(self(), :messages)
        |> elem(1)
        |> Enum.map(fn {:telemetry, e, m, meta} ->
          {List.last(e), m, Map.drop(meta, [:server])}
        end)
        |> Enum.frequencies_by(&elem(&1, 0))
      )

      both =
        for {{:ok, a}, {:ok, b}} <- Enum.zip(overlapped, planned) do
          assert a == b
        end

      assert length(both) >= 4
    end
  end

  # a greedy 4-slot server of its own, once its model is loaded
  defp start_ready!(path, opts) do
    {:ok, s} = Server.start_link([model_path: path, n_parallel: 4, temp: 0.0] ++ opts)
    {:ok, _} = wait_model(s)
    s
  end

  defp queued_ticks(s, n) do
    receive do
      {:telemetry, [_, _, :tick], _, %{server: ^s, queued: q}} ->
        queued_ticks(s, if(q, do: n + 1, else: n))
    after
      0 -> n
    end
  end

  describe "isolation and backpressure" do
    test "queue_full and context_full fail only the offending request", %{path: path} do
      {:ok, s} =
        Server.start_link(model_path: path, n_parallel: 2, n_ctx: 256, max_queue: 1, temp: 0.0)

      {:ok, _} = wait_model(s)
      ref = make_ref()
      # grows beyond the 256-token budget while a short request completes beside it
      :ok = Server.subscribe_stream_tokens(s, Enum.to_list(100..150), ref, max_tokens: 400)
      assert {:ok, _} = Server.generate(s, "Hi there", max_tokens: 8)
      assert_receive {^ref, {:error, :context_full}}, 60_000
      assert Process.alive?(s)
      assert {:ok, _} = Server.generate(s, "Still working", max_tokens: 4)

      # queue bound: one long request per slot plus one queued, then rejection
      refs = for _ <- 1..3, do: make_ref()

      results =
        for r <- refs,
            do: Server.subscribe_stream_tokens(s, Enum.to_list(200..210), r, max_tokens: 100)

      assert results == [:ok, :ok, :ok]
      assert {:error, :queue_full} = Server.generate(s, "one too many", max_tokens: 2)

      assert [{:error, :queue_full}] =
               s |> Server.stream("again", max_tokens: 2) |> Enum.to_list()

      Enum.each(refs, &Server.cancel(s, &1))
      GenServer.stop(s)
    end

    test "a request the KV cache cannot take now waits in the queue instead of failing", %{
      path: path
    } do
      attach([
        [:llama_cpp_ex, :server, :request, :start],
        [:llama_cpp_ex, :server, :request, :done]
      ])

      {:ok, s} = Server.start_link(model_path: path, n_parallel: 2, n_ctx: 256, temp: 0.0)
      {:ok, _} = wait_model(s)
      # 150 + up to 60 tokens, then 150 more: both cannot be in the 256-token budget at once
      a =
        Task.async(fn -> Server.complete_tokens(s, Enum.to_list(1000..1149), max_tokens: 60) end)

      Process.sleep(20)
      b = Task.async(fn -> Server.complete_tokens(s, Enum.to_list(2000..2149), max_tokens: 8) end)
      assert {:ok, %{finish_reason: ra}} = Task.await(a, 60_000)
      assert {:ok, %{finish_reason: rb}} = Task.await(b, 60_000)
      assert ra in [:eog, :max_tokens] and rb in [:eog, :max_tokens]

      # b started only once a was done (it waited in the queue, not in a slot)
      events =
        for _ <- 1..4 do
          assert_receive {:telemetry, [_, _, :request, kind], m, _}, 5_000
          {kind, m.prompt_tokens}
        end

      assert [{:start, 150}, {:done, 150}, {:start, 150}, {:done, 150}] = events
      assert_no_leaks(s)
      GenServer.stop(s)
    end

    test "idle caches are evicted before an active request fails", %{path: path} do
      attach([[:llama_cpp_ex, :server, :kv_pressure]])
      {:ok, s} = Server.start_link(model_path: path, n_parallel: 2, n_ctx: 256, temp: 0.0)
      {:ok, _} = wait_model(s)
      # fill slot caches with long idle prefixes
      {:ok, _} = Server.generate_tokens(s, Enum.to_list(300..420), max_tokens: 2)
      {:ok, _} = Server.generate_tokens(s, Enum.to_list(500..620), max_tokens: 2)
      # a new request needing most of the budget evicts them and completes
      assert {:ok, _} = Server.generate_tokens(s, Enum.to_list(700..900), max_tokens: 8)
      assert_receive {:telemetry, _, %{purged_slots: p}, _}, 5_000
      assert p >= 1
      assert_no_leaks(s)
      GenServer.stop(s)
    end
  end

  defmodule EveryOtherTick do
    @moduledoc false
    def build_batch(slots, budget, chunk, opts) do
      if Keyword.fetch!(opts, :queue_depth) > 4,
        do: LlamaCppEx.Server.Strategy.PrefillPriority.build_batch(slots, budget, chunk, opts),
        else: LlamaCppEx.Server.Strategy.DecodeMaximal.build_batch(slots, budget, chunk, opts)
    end
  end

  test "every strategy, built-in or custom, serves requests", %{path: path} do
    strategies = [
      LlamaCppEx.Server.Strategy.PrefillPriority,
      LlamaCppEx.Server.Strategy.Balanced,
      LlamaCppEx.Server.Strategy.Fair,
      LlamaCppEx.Server.Strategy.LatencyFirst,
      LlamaCppEx.Server.Strategy.ThroughputFirst,
      EveryOtherTick
    ]

    {:ok, expected} =
      LlamaCppEx.generate(TestModels.smollm2(), "Colors: red, green,", max_tokens: 10, temp: 0.0)

    for strategy <- strategies do
      {:ok, s} =
        Server.start_link(
          model_path: path,
          n_parallel: 2,
          n_ctx: 1024,
          temp: 0.0,
          batch_strategy: strategy,
          chunk_size: 3
        )

      {:ok, _} = wait_model(s)

      tasks =
        for _ <- 1..3,
            do: Task.async(fn -> Server.generate(s, "Colors: red, green,", max_tokens: 10) end)

      assert Enum.map(tasks, &Task.await(&1, 60_000)) == List.duplicate({:ok, expected}, 3),
             inspect(strategy)

      GenServer.stop(s)
    end
  end

  test "prefix instability is reported for a diverging prompt, not for a repeated one",
       %{server: server} do
    event = [:llama_cpp_ex, :server, :prefix_instability]
    attach([event])
    prompt = "Write a long story about a lighthouse keeper who finds a message in a bottle."
    {:ok, _} = Server.generate(server, prompt, max_tokens: 96)
    {:ok, _} = Server.generate(server, prompt, max_tokens: 4)
    refute_receive {:telemetry, ^event, _, _}, 100

    {:ok, _} = Server.generate(server, prompt, max_tokens: 96)
    {:ok, _} = Server.generate(server, prompt <> " Then tell it again as a poem.", max_tokens: 4)
    assert_receive {:telemetry, ^event, %{matched_tokens: m, cached_tokens: c}, _}, 1000
    assert m < c
  end
end
