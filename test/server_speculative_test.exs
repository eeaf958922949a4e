defmodule LlamaCppEx.ServerSpeculativeTest do
  @moduledoc """
  Speculation per request in the Server (prompt lookup, and a draft model started with the
  Server): drafts and their verification are more rows of the same forward pass as everyone
  else's decode. The text is the one without
  speculation (greedy and seeded), next to plain requests too; the cache stays consistent when
  a request ends inside a verified draft; acceptance shows in telemetry and `get_stats/1`.
  """
  use ExUnit.Case, async: false

  alias LlamaCppEx.{Chat, Server, TestModels}

  @moduletag timeout: 600_000

  @paragraph "The committee met on Tuesday to review the budget for the new library. After a " <>
               "long discussion, the members agreed to fund the children's reading room and to " <>
               "extend the opening hours on weekends."

  setup_all do
    {server, model} = TestModels.start_server(n_parallel: 3, n_ctx: 4096)

    {:ok, prompt} =
      Chat.apply_template(model, [
        %{role: "user", content: "Repeat this text exactly:\n" <> @paragraph}
      ])

    %{server: server, prompt: prompt}
  end

  defp attach_done do
    parent = self()
    id = make_ref()

    :telemetry.attach(
      id,
      [:llama_cpp_ex, :server, :request, :done],
      fn _, m, meta, _ -> send(parent, {:done, m, meta}) end,
      nil
    )

    on_exit(fn -> :telemetry.detach(id) end)
  end

  defp audit_consistent(server) do
    {:ok, audit} = Server.kv_audit(server)
    [owners | _] = audit.owners

    for {seq, blocks} <- owners do
      cached = audit.cached_tokens[seq]
      assert blocks == div(cached + 15, 16), "seq #{seq}: #{blocks} blocks for #{cached} tokens"
    end
  end

  test "the same text with and without speculation, greedy and seeded", %{
    server: server,
    prompt: prompt
  } do
    attach_done()

    for opts <- [[temp: 0.0], [temp: 0.8, seed: 11, penalty_repeat: 1.1]] do
      opts = [max_tokens: 60, cache_prompt: false] ++ opts
      {:ok, plain} = Server.generate(server, prompt, opts)
      assert_receive {:done, %{drafted_tokens: 0}, _}, 5_000

      {:ok, fast} = Server.generate(server, prompt, [speculative: [n_draft: 6]] ++ opts)

      assert fast == plain
      assert_receive {:done, m, _}, 5_000
      assert m.drafted_tokens > 0
      assert m.accepted_tokens > 0 and m.accepted_tokens <= m.drafted_tokens
      assert m.acceptance_rate == m.accepted_tokens / m.drafted_tokens

      streamed = server |> Server.stream(prompt, [speculative: []] ++ opts) |> Enum.join()
      assert streamed == plain
    end

    stats = Server.get_stats(server)
    assert stats.speculative_accepted > 0
    assert stats.speculative_acceptance > 0 and stats.speculative_acceptance <= 1
    audit_consistent(server)
  end

  test "speculating and plain requests share passes; each gets its own text", %{
    server: server,
    prompt: prompt
  } do
    other = "Once upon a time, in a lighthouse by the sea, there lived"
    opts = [max_tokens: 40, temp: 0.0, cache_prompt: false]
    {:ok, want_a} = Server.generate(server, prompt, opts)
    {:ok, want_b} = Server.generate(server, other, opts)

    tasks = [
      Task.async(fn -> Server.generate(server, prompt, [speculative: []] ++ opts) end),
      Task.async(fn -> Server.generate(server, other, opts) end),
      Task.async(fn -> Server.generate(server, other, [speculative: [n_draft: 3]] ++ opts) end)
    ]

    assert [{:ok, ^want_a}, {:ok, ^want_b}, {:ok, ^want_b}] = Task.await_many(tasks, 60_000)
  end

  test "ending inside a verified draft leaves the cache as the slot says", %{
    server: server,
    prompt: prompt
  } do
    # max_tokens and a stop string both cut a request while drafts run ahead of it
    for opts <- [[max_tokens: 13], [max_tokens: 60, stop: ["reading"]]] do
      {:ok, plain} = Server.generate(server, prompt, [temp: 0.0] ++ opts)
      {:ok, fast} = Server.generate(server, prompt, [temp: 0.0, speculative: []] ++ opts)
      assert fast == plain
      audit_consistent(server)
      # the cached prefix is reused by the next request, and must hold exactly those tokens
      {:ok, again} = Server.generate(server, prompt, [temp: 0.0, speculative: []] ++ opts)
      assert again == plain
    end
  end

  test "a multi-turn continuation of a request cut inside a draft reuses exactly its cache", %{
    server: server,
    prompt: prompt
  } do
    {:ok, model} = Server.fetch_model(server)
    {:ok, ids} = LlamaCppEx.Tokenizer.encode(model, prompt)

    for max <- [5, 9, 13, 17] do
      opts = [temp: 0.0, top_logprobs: 1, max_tokens: max]
      {:ok, plain} = Server.complete_tokens(server, ids, opts)
      {:ok, fast} = Server.complete_tokens(server, ids, [speculative: []] ++ opts)
      assert fast.text == plain.text
      # greedy: the sampled tokens are the top-1 ones
      generated = for {_piece, {_lp, [{id, _, _} | _]}} <- fast.logprobs, do: id
      # the next turn extends exactly what the slot cached (the prompt and every generated
      # token but the last): no trim is sent, so stray draft tokens in the cache would break it
      next = ids ++ generated ++ ids

      {:ok, want} =
        Server.complete_tokens(server, next, max_tokens: 4, temp: 0.0, cache_prompt: false)

      assert {:ok, got} = Server.complete_tokens(server, next, max_tokens: 4, temp: 0.0)
      assert got.text == want.text
    end
  end

  test "invalid speculation options raise in the caller", %{server: server} do
    assert_raise ArgumentError, ~r/n_draft/, fn ->
      Server.generate(server, "hi", max_tokens: 2, speculative: [n_draft: 0])
    end

    assert_raise ArgumentError, ~r/draft model/, fn ->
      Server.generate(server, "hi",
        max_tokens: 2,
        speculative: [mode: :draft, draft_model: TestModels.smollm2()]
      )
    end

    # a server without a draft model refuses draft-model requests
    assert {:error, msg} =
             Server.generate(server, "hi", max_tokens: 2, speculative: [mode: :draft])

    assert msg =~ "draft_model"
  end

  test "draft-model speculation: a draft model's drafts are more rows of the shared pass", %{
    prompt: prompt
  } do
    # the target is SmolLM2 re-quantized to Q8_0; its Q4_1 file drafts (they disagree now
    # and then, so drafts are both accepted and rejected)
    {server, _} =
      TestModels.start_server(
        n_parallel: 3,
        n_ctx: 4096,
        requantize: :all,
        draft_model: TestModels.smollm2_path()
      )

    attach_done()
    other = "Once upon a time, in a lighthouse by the sea, there lived"

    for opts <- [[temp: 0.0], [temp: 0.8, seed: 5, penalty_repeat: 1.1]] do
      opts = [max_tokens: 40, cache_prompt: false] ++ opts
      {:ok, want_a} = Server.generate(server, prompt, opts)
      {:ok, want_b} = Server.generate(server, other, opts)
      flush_done()

      tasks = [
        Task.async(fn ->
          Server.generate(server, prompt, [speculative: [mode: :draft]] ++ opts)
        end),
        Task.async(fn -> Server.generate(server, other, opts) end),
        Task.async(fn ->
          Server.generate(server, other, [speculative: [mode: :draft, n_draft: 6]] ++ opts)
        end),
        Task.async(fn -> Server.generate(server, prompt, [speculative: []] ++ opts) end)
      ]

      assert [{:ok, ^want_a}, {:ok, ^want_b}, {:ok, ^want_b}, {:ok, ^want_a}] =
               Task.await_many(tasks, 120_000)

      drafted = for _ <- 1..4, do: assert_receive({:done, m, _}, 5_000) && m.drafted_tokens
      assert Enum.count(drafted, &(&1 > 0)) >= 3
    end

    stats = Server.get_stats(server)
    assert stats.speculative_accepted > 0
    assert stats.speculative_accepted < stats.speculative_drafted
    audit_consistent(server)
  end

  @tag capture_log: true
  test "a draft model with another vocabulary fails the start" do
    Process.flag(:trap_exit, true)

    {:ok, pid} =
      Server.start_link(
        model_path: TestModels.smollm2_path(),
        draft_model: TestModels.gemma3_path(),
        n_parallel: 1,
        n_ctx: 256
      )

    assert_receive {:EXIT, ^pid, {:load_failed, msg}}, 60_000
    assert msg =~ "vocabulary"

    assert {:error, {:invalid_draft_model, 3}} =
             Server.start_link(model_path: TestModels.smollm2_path(), draft_model: 3)
  end

  defp flush_done do
    receive do
      {:done, _, _} -> flush_done()
    after
      0 -> :ok
    end
  end
end
