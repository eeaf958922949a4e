defmodule LlamaCppEx.ServerPromptCacheTest do
  # The level-2 RAM prompt cache (:prompt_cache_ram_mb) and save_prefix/load_prefix, on
  # SmolLM2: caches about to be lost are copied to RAM and restored on a prefix hit, giving
  # the same greedy text as evaluating the prompt.
  use ExUnit.Case, async: false

  alias LlamaCppEx.{Server, TestModels, Tokenizer}

  @moduletag timeout: 600_000

  @ram [:llama_cpp_ex, :server, :ram_cache]
  @start [:llama_cpp_ex, :server, :request, :start]

  @system_a String.duplicate(
              "You are a lighthouse keeper's assistant. Answer about tides, ships and lamps. ",
              6
            )
  @system_b String.duplicate("You are a baker. Answer about bread, ovens and flour only. ", 6)

  setup_all do
    # the reference: the same prompts evaluated in full
    {plain, model} = TestModels.start_server(n_parallel: 1, n_ctx: 2048, temp: 0.0)
    %{plain: plain, model: model}
  end

  defp ids(model, text) do
    {:ok, ids} = Tokenizer.encode(model, text)
    ids
  end

  defp complete(server, ids, n \\ 12) do
    {:ok, %{text: text}} = Server.complete_tokens(server, ids, max_tokens: n)
    text
  end

  defp flush_telemetry do
    receive do
      {:telemetry, _, _, _} -> flush_telemetry()
    after
      0 -> :ok
    end
  end

  defp assert_no_leaks(server) do
    {:ok, audit} = Server.kv_audit(server)

    for {seq, blocks} <- List.first(audit.owners) do
      assert blocks == div(audit.cached_tokens[seq] + 15, 16)
    end
  end

  test "a conversation whose slot was taken comes back from RAM", %{plain: plain, model: m} do
    {server, _} =
      TestModels.start_server(n_parallel: 1, n_ctx: 2048, temp: 0.0, prompt_cache_ram_mb: 64)

    TestModels.attach_telemetry([@ram, @start])

    a1 = ids(m, @system_a <> "Question: when is high tide?")
    b1 = ids(m, @system_b <> "Question: how hot is the oven?")
    complete(server, a1)
    refute_received {:telemetry, @ram, _, _}

    # B takes the only slot: A's cache is copied first
    complete(server, b1)
    assert_receive {:telemetry, @ram, %{tokens: saved, bytes: bytes}, %{op: :save}}, 5_000
    assert saved >= length(a1)

    assert %{ram_cache_entries: 1, ram_cache_bytes: ^bytes, ram_cache_saves: 1} =
             Server.get_stats(server)

    # A's next turn restores its prefix instead of evaluating it
    flush_telemetry()
    a2 = a1 ++ ids(m, " And when is low tide?")
    text = complete(server, a2)
    assert_receive {:telemetry, @ram, %{tokens: restored}, %{op: :restore}}, 5_000
    assert restored >= length(a1)
    assert_receive {:telemetry, @start, %{prefix_cache_tokens: ^restored}, _}, 5_000
    assert Server.get_stats(server).ram_cache_hits == 1
    # B's cache was copied in turn when A took the slot back
    assert_receive {:telemetry, @ram, _, %{op: :save}}, 5_000

    # the same tokens as a server that evaluated the whole prompt
    complete(plain, b1)
    assert text == complete(plain, a2)
    assert_no_leaks(server)
  end

  test "caches evicted under KV pressure are kept and restored", %{plain: plain, model: m} do
    # blocks of 16 tokens for n_ctx 192: two ~110-token conversations cannot both stay cached
    {server, _} =
      TestModels.start_server(n_parallel: 2, n_ctx: 192, temp: 0.0, prompt_cache_ram_mb: 64)

    TestModels.attach_telemetry([@ram, @start, [:llama_cpp_ex, :server, :kv_pressure]])

    a1 = ids(m, @system_a <> "Question: when is high tide?")
    # B's prompt alone needs more blocks than A's cached prompt leaves free, whatever either
    # generates (an early end of B's greedy text once left room for both)
    b1 = ids(m, @system_b <> @system_b <> "Question: how hot is the oven?")
    {:ok, %{n_blocks: n_blocks}} = Server.kv_audit(server)
    assert div(length(a1) + 15, 16) + div(length(b1) + 15, 16) > n_blocks
    assert max(length(a1), length(b1)) < n_blocks * 16 - 16
    complete(server, a1)
    complete(server, b1)
    assert_receive {:telemetry, [_, _, :kv_pressure], %{purged_slots: 1}, _}, 5_000
    assert_receive {:telemetry, @ram, %{tokens: saved}, %{op: :save}}, 5_000
    assert saved >= length(a1)

    flush_telemetry()
    a2 = a1 ++ ids(m, " And when is low tide?")
    text = complete(server, a2)
    assert_receive {:telemetry, @ram, %{tokens: restored}, %{op: :restore}}, 5_000
    assert restored >= length(a1)
    assert_receive {:telemetry, @start, %{prefix_cache_tokens: ^restored}, _}, 5_000

    complete(plain, b1)
    assert text == complete(plain, a2)
    assert_no_leaks(server)
  end

  test "the byte budget evicts the oldest entries", %{model: m} do
    # SmolLM2 caches 23 KiB per token in f16: 2 MiB holds one 3-block entry, not two
    {server, _} =
      TestModels.start_server(n_parallel: 1, n_ctx: 2048, temp: 0.0, prompt_cache_ram_mb: 2)

    TestModels.attach_telemetry([@ram])

    prompts =
      for topic <- ["tides and ships", "bread and ovens", "stars and planets"] do
        ids(
          m,
          "The old story about #{topic} begins on a grey morning, when the keeper of the " <>
            "harbour walked down to the water and looked far out to the east, where"
        )
      end

    # 33 prompt tokens and up to 3 generated ones fed: 3 blocks each
    assert Enum.all?(prompts, &(length(&1) in 33..44))
    Enum.each(prompts, &complete(server, &1, 4))
    assert_receive {:telemetry, @ram, %{tokens: t1}, %{op: :save}}, 5_000
    assert_receive {:telemetry, @ram, %{tokens: ^t1}, %{op: :evict}}, 5_000
    stats = Server.get_stats(server)
    assert stats.ram_cache_entries == 1
    assert stats.ram_cache_evictions == 1
    assert stats.ram_cache_bytes <= stats.ram_cache_budget_bytes
    assert stats.ram_cache_budget_bytes == 2 * 1_048_576
  end

  describe "save_prefix/4 and load_prefix/3" do
    @tag :tmp_dir
    test "a saved system prompt starts another server", %{plain: plain, model: m, tmp_dir: dir} do
      path = Path.join(dir, "system.prefix")
      system = ids(m, @system_a)
      assert :ok = Server.save_prefix(plain, system, path)

      {server, _} =
        TestModels.start_server(n_parallel: 1, n_ctx: 2048, temp: 0.0, prompt_cache_ram_mb: 64)

      TestModels.attach_telemetry([@ram, @start])
      assert :ok = Server.load_prefix(server, path)
      assert_receive {:telemetry, @ram, %{tokens: n}, %{op: :save}}, 5_000
      assert n == length(system)
      assert Server.get_stats(server).ram_cache_entries == 1

      prompt = system ++ ids(m, "Question: when is high tide?")
      text = complete(server, prompt)
      assert_receive {:telemetry, @start, %{prefix_cache_tokens: ^n}, _}, 5_000
      assert_receive {:telemetry, @ram, %{tokens: ^n}, %{op: :restore}}, 5_000

      # the reference evaluates the prompt from scratch (another scope shares nothing)
      {:ok, %{text: expected}} =
        Server.complete_tokens(plain, prompt, max_tokens: 12, cache_scope: :cold)

      assert text == expected

      # another scope does not see it
      flush_telemetry()
      complete_scoped = Server.complete_tokens(server, prompt, max_tokens: 2, cache_scope: :other)
      assert {:ok, _} = complete_scoped
      assert_receive {:telemetry, @start, %{prefix_cache_tokens: 0}, _}, 5_000
      assert_no_leaks(server)
    end

    @tag :tmp_dir
    test "files that do not fit are refused", %{plain: plain, model: m, tmp_dir: dir} do
      path = Path.join(dir, "p.prefix")
      assert :ok = Server.save_prefix(plain, @system_b, path, cache_scope: "tenant")

      # the RAM cache is off in the plain server
      assert {:error, :prompt_cache_disabled} = Server.load_prefix(plain, path)

      {server, _} = TestModels.start_server(n_parallel: 1, n_ctx: 1024, prompt_cache_ram_mb: 1)
      assert {:error, {:prompt_cache_too_small, _}} = Server.load_prefix(server, path)

      {q8, _} =
        TestModels.start_server(
          n_parallel: 1,
          n_ctx: 1024,
          type_k: :q8_0,
          prompt_cache_ram_mb: 64
        )

      assert {:error, message} = Server.load_prefix(q8, path)
      assert message =~ "KV cache types"

      bad = Path.join(dir, "bad.prefix")
      File.write!(bad, "not a prefix file")
      assert {:error, :invalid_prefix_file} = Server.load_prefix(plain, bad)
      assert {:error, :enoent} = Server.load_prefix(plain, Path.join(dir, "missing"))

      term = path |> File.read!() |> :erlang.binary_to_term()

      File.write!(bad, :erlang.term_to_binary(%{term | model: %{term.model | n_params: 1}}))
      assert {:error, :model_mismatch} = Server.load_prefix(plain, bad)

      File.write!(bad, :erlang.term_to_binary(%{term | kv: binary_part(term.kv, 0, 100)}))
      assert {:error, :invalid_prefix_file} = Server.load_prefix(plain, bad)

      File.write!(bad, :erlang.term_to_binary(%{term | tokens: Enum.drop(term.tokens, 1)}))
      assert {:error, :invalid_prefix_file} = Server.load_prefix(plain, bad)

      assert {:error, :empty_prompt} = Server.save_prefix(plain, [], path)
      assert {:error, :invalid_token} = Server.save_prefix(plain, [10_000_000], path)

      assert_raise ArgumentError, ~r/scope/, fn ->
        Server.save_prefix(plain, "x", path, scope: 1)
      end

      assert length(term.tokens) == length(ids(m, @system_b))
    end
  end

  test "configuration" do
    Process.flag(:trap_exit, true)
    path = TestModels.smollm2_path()

    assert {:error, "invalid prompt_cache_ram_mb: -1"} =
             Server.start_link(model_path: path, prompt_cache_ram_mb: -1)

    assert {:error, "invalid prompt_cache_ram_mb: 1.5"} =
             Server.start_link(model_path: path, prompt_cache_ram_mb: 1.5)
  end
end
