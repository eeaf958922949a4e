defmodule LlamaCppEx.ServerKvPolicyTest do
  use ExUnit.Case, async: false

  alias LlamaCppEx.Server
  alias LlamaCppEx.Server.KvPolicy
  alias LlamaCppEx.TestModels

  @event [:llama_cpp_ex, :server, :kv_precision]
  @no_eos %{0 => :neg_infinity, 1 => :neg_infinity, 2 => :neg_infinity}

  describe "KvPolicy" do
    test "defaults are oxibonsai's and the policy starts at :min" do
      assert {:ok, p} = KvPolicy.new(true)

      assert %{q8_threshold: 0.8, q4_threshold: 0.95, hysteresis: 0.05, ewma_alpha: 0.2} = p
      assert {p.level, KvPolicy.levels(p), KvPolicy.tier(p)} == {:f16, [:f16, :q8_0, :q4_0], 0}

      {:ok, p} = KvPolicy.new(min: :q8_0)
      assert {p.level, KvPolicy.levels(p)} == {:q8_0, [:q8_0, :q4_0]}
    end

    test "the average climbs through the thresholds and comes back with hysteresis" do
      {:ok, p} = KvPolicy.new(ewma_alpha: 0.5)
      # 0.5 per step towards 1.0: 0.5, 0.75, 0.875 (q8), 0.9375, 0.96875 (q4)
      {levels, p} =
        Enum.map_reduce(1..5, p, fn _, p ->
          {p, _} = KvPolicy.update(p, 1.0)
          {p.level, p}
        end)

      assert levels == [:f16, :f16, :q8_0, :q8_0, :q4_0]
      assert p.changes == 2

      # down to 0.9 (≥ 0.95 - 0.05): stays q4_0; 0.85 → q8_0; 0.78 (≥ 0.75) stays; 0.74 → f16
      p = %{p | ewma_alpha: 1.0}
      {p, nil} = KvPolicy.update(p, 0.9)
      assert p.level == :q4_0
      {p, {:q4_0, :q8_0}} = KvPolicy.update(p, 0.85)
      {p, nil} = KvPolicy.update(p, 0.78)
      {p, {:q8_0, :f16}} = KvPolicy.update(p, 0.74)
      assert p.changes == 4
    end

    test "a jump past both thresholds goes straight to the lowest level, clamped to :max" do
      {:ok, p} = KvPolicy.new(ewma_alpha: 1.0, max: :q8_0)
      assert {%{level: :q8_0}, {:f16, :q8_0}} = KvPolicy.update(p, 0.99)
      {:ok, p} = KvPolicy.new(ewma_alpha: 1.0)
      assert {%{level: :q4_0}, {:f16, :q4_0}} = KvPolicy.update(p, 0.99)
    end

    test "invalid configurations are clear errors" do
      bad = fn opts ->
        assert {:error, {:invalid_kv_policy, msg}} = KvPolicy.new(opts)
        msg
      end

      assert bad.(q8_threshold: 0.9, q4_threshold: 0.8) =~ "must be above :q8_threshold"
      assert bad.(q8_threshold: 0.9, q4_threshold: 0.9) =~ "must be above"
      assert bad.(q8_threshold: 1.5) =~ ":q8_threshold must be a number in (0, 1]"
      assert bad.(q4_threshold: 0) =~ ":q4_threshold"
      assert bad.(ewma_alpha: 0.0) =~ ":ewma_alpha"
      assert bad.(hysteresis: -0.1) =~ ":hysteresis"
      assert bad.(hysteresis: 0.9) =~ ":hysteresis"
      assert bad.(q8_threshold: "high") =~ ~s(got: "high")
      assert bad.(min: :q4_0, max: :q8_0) =~ "higher precision"
      assert bad.(min: :f16, max: :f16) =~ "higher precision"
      assert bad.(max: :q5_0) =~ ":max must be one of"
      assert bad.(:on) =~ "expected a keyword list"

      assert_raise ArgumentError, ~r/unknown option: :q8_treshold/, fn ->
        KvPolicy.new(q8_treshold: 0.5)
      end
    end
  end

  describe "a Server with kv_policy" do
    test "start options are validated before anything loads" do
      Process.flag(:trap_exit, true)
      path = TestModels.smollm2_path()

      assert {:error, {:invalid_kv_policy, msg}} =
               Server.start_link(model_path: path, kv_policy: [q8_threshold: 0.96])

      assert msg =~ ":q4_threshold (0.95) must be above :q8_threshold (0.96)"

      assert {:error, {:invalid_kv_policy, msg}} =
               Server.start_link(model_path: path, kv_policy: [], type_k: :q8_0)

      assert msg =~ ":type_k :q8_0 conflicts with :kv_policy"

      assert_raise ArgumentError, ~r/kv_policy: unknown option: :alpha/, fn ->
        Server.start_link(model_path: path, kv_policy: [alpha: 0.5])
      end
    end

    test "new blocks go to q8_0 then q4_0 as the cache fills, and more tokens fit the budget" do
      TestModels.attach_telemetry([@event])

      {s, _model} =
        TestModels.start_server(
          n_parallel: 4,
          n_ctx: 512,
          temp: 0.0,
          kv_policy: [q8_threshold: 0.5, q4_threshold: 0.75, ewma_alpha: 1.0]
        )

      assert %{kv_precision: :f16, kv_precision_changes: 0, kv_occupancy: occupancy} =
               Server.get_stats(s)

      assert occupancy == 0.0

      # 4 × (prompt + 170 tokens) is more than the 512 tokens the budget holds in f16
      tasks =
        for name <- ~w(Bob Alice Carol Dave) do
          Task.async(fn ->
            Server.generate_tokens(
              s,
              tokens(s, "Once upon a time there was a dragon called #{name}. One day, #{name}"),
              max_tokens: 170,
              logit_bias: @no_eos
            )
          end)
        end

      results = Task.await_many(tasks, 240_000)

      for r <- results do
        assert {:ok, text} = r
        assert String.length(text) > 200
      end

      assert_receive {:telemetry, @event, %{occupancy: o1, ewma: e1}, %{from: :f16, to: :q8_0}},
                     1_000

      assert o1 >= 0.5 and e1 >= 0.5
      assert_receive {:telemetry, @event, %{occupancy: o2}, %{from: :q8_0, to: :q4_0}}, 1_000
      assert o2 >= 0.75

      stats = Server.get_stats(s)
      assert stats.kv_precision == :q4_0
      assert stats.kv_precision_changes >= 2
      assert stats.kv_occupancy <= 1.0

      # every sequence's blocks cover exactly what it caches, whatever their precision
      {:ok, audit} = Server.kv_audit(s)
      [owners] = audit.owners

      total_cached =
        for {seq, blocks} <- owners, reduce: 0 do
          acc ->
            assert blocks == div(audit.cached_tokens[seq] + 15, 16)
            acc + audit.cached_tokens[seq]
        end

      assert total_cached > 512 + 16, "the cache holds more tokens than its f16 budget"

      # a fresh request after the pressure: the policy only goes back up as occupancy falls
      assert {:ok, _} = Server.generate(s, "The capital of France is", max_tokens: 8)
    end
  end

  defp tokens(server, text) do
    {:ok, model} = TestModels.wait_model(server)
    {:ok, ids} = LlamaCppEx.Tokenizer.encode(model, text)
    ids
  end
end
