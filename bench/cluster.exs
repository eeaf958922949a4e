# Server replicas on several BEAM nodes (LlamaCppEx.Cluster), on one machine's cores.
#
#   ELIXIR_ERL_OPTIONS="+sbwt none +sbwtdcpu none +sbwtdio none" \
#   LLAMA_MODEL_PATH=path/to/model.gguf [LLAMA_THREADS=2] [CLUSTER_PARTS=scaling,routing] \
#     mix run bench/cluster.exs
#
# Part 1, scaling: the machine's LLAMA_THREADS threads split between 1, 2 and 3 peer nodes
# (threads per node = max(1, LLAMA_THREADS / nodes)), 8 concurrent greedy streams of 64
# tokens routed least-loaded; aggregate tok/s and TTFT p50/p99.
# Part 2, routing: 2 nodes, 8 conversations x 4 turns under one shared system prompt, each
# opening with ~300 tokens of notes of its own, each conversation's turns in order and the
# conversations at once; placement at random, by
# prompt-prefix affinity, and by `:session` affinity. TTFT p50/p99, and the prompt tokens
# the replicas actually evaluated (prompt tokens less prefix-cache hits, from their stats).

Code.require_file("../test/support/peers.ex", __DIR__)

alias LlamaCppEx.{Cluster, Peers, Server}

defmodule Bench.Cluster do
  @system "You are a meticulous assistant for a lighthouse museum. Answer visitors' questions " <>
            "about the history of lighthouses, their keepers, lenses, fog signals and the " <>
            "ships they guided. Keep answers short, factual and friendly, and when you are " <>
            "unsure, say so plainly instead of guessing. Mention a related exhibit when one " <>
            "fits the question, and never invent dates or names."

  def pct([], _), do: 0.0

  def pct(xs, p) do
    s = Enum.sort(xs)
    Enum.at(s, min(length(s) - 1, round(p * (length(s) - 1))))
  end

  def start_replicas(model, n_nodes, threads, slots, group) do
    for i <- 1..n_nodes do
      {_peer, node} = Peers.start!(:"bench_#{i}")

      opts = [
        model_path: model,
        n_parallel: slots,
        n_ctx: 8192,
        n_threads: threads,
        cluster: group
      ]

      Peers.start_server!(node, opts)
    end
  end

  # one text stream: {ttft_ms, chunks, text}
  def timed(stream) do
    t0 = System.monotonic_time(:microsecond)

    {ttft, n, text} =
      Enum.reduce(stream, {nil, 0, []}, fn
        {:error, reason}, _ -> raise "stream failed: #{inspect(reason)}"
        t, {nil, n, acc} -> {(System.monotonic_time(:microsecond) - t0) / 1000, n + 1, [acc, t]}
        t, {ttft, n, acc} -> {ttft, n + 1, [acc, t]}
      end)

    {ttft, n, IO.iodata_to_binary(text)}
  end

  def scaling(model, threads) do
    IO.puts("\n## Scaling: 8 streams x 64 tokens, least-loaded")
    IO.puts("| nodes | threads/node | tok/s | TTFT p50 ms | TTFT p99 ms |\n|---|---|---|---|---|")

    for nodes <- [1, 2, 3] do
      group = :"bench_scaling_#{nodes}"
      per = max(div(threads, nodes), 1)
      # 8 slots in all, so that no configuration queues
      replicas = start_replicas(model, nodes, per, div(8 + nodes - 1, nodes), group)
      Process.sleep(300)
      # warm-up
      {:ok, _} = Cluster.generate(group, "Hello", max_tokens: 4)
      t0 = System.monotonic_time(:millisecond)

      results =
        1..8
        |> Task.async_stream(
          fn i ->
            {ttft, n, _text} =
              timed(
                Cluster.stream(group, "Story #{i}: the lighthouse keeper",
                  max_tokens: 64,
                  temp: 0.0,
                  route: :least_loaded
                )
              )

            {ttft, n}
          end,
          max_concurrency: 8,
          timeout: :infinity
        )
        |> Enum.map(fn {:ok, r} -> r end)

      wall = System.monotonic_time(:millisecond) - t0
      tokens = results |> Enum.map(&elem(&1, 1)) |> Enum.sum()
      ttfts = Enum.map(results, &elem(&1, 0))

      IO.puts(
        "| #{nodes} | #{per} | #{Float.round(tokens * 1000 / wall, 1)} | " <>
          "#{Float.round(pct(ttfts, 0.5), 1)} | #{Float.round(pct(ttfts, 0.99), 1)} |"
      )

      Enum.each(replicas, &GenServer.stop/1)
    end
  end

  def routing(model, threads) do
    IO.puts("\n## Routing: 2 nodes, 8 conversations x 4 turns, one shared system prompt")

    IO.puts(
      "| placement | TTFT p50 ms | TTFT p99 ms | prompt tokens | evaluated | wall s |\n" <>
        "|---|---|---|---|---|---|"
    )

    for {label, extra} <- [
          {"random", fn _ -> [route: :random] end},
          {"prefix affinity", fn _ -> [] end},
          {"session affinity", fn c -> [session: c] end}
        ] do
      group = :"bench_routing_#{System.unique_integer([:positive])}"
      replicas = start_replicas(model, 2, max(div(threads, 2), 1), 8, group)
      Process.sleep(300)
      t0 = System.monotonic_time(:millisecond)

      ttfts =
        1..8
        |> Task.async_stream(fn c -> conversation(group, c, extra.(c)) end,
          max_concurrency: 8,
          timeout: :infinity
        )
        |> Enum.flat_map(fn {:ok, r} -> r end)

      wall = (System.monotonic_time(:millisecond) - t0) / 1000
      stats = Enum.map(replicas, &Server.get_stats/1)
      prompt = stats |> Enum.map(& &1.prompt_tokens) |> Enum.sum()
      hits = stats |> Enum.map(& &1.prefix_cache_tokens) |> Enum.sum()

      IO.puts(
        "| #{label} | #{Float.round(pct(ttfts, 0.5), 1)} | #{Float.round(pct(ttfts, 0.99), 1)} | " <>
          "#{prompt} | #{prompt - hits} | #{Float.round(wall, 1)} |"
      )

      Enum.each(replicas, &GenServer.stop/1)
    end
  end

  # each visitor brings notes of their own (~300 tokens), which only their replica caches
  defp conversation(group, c, opts) do
    notes =
      Enum.map_join(1..12, " ", fn i ->
        "Visitor #{c} note #{i}: I saw tower #{c * 13 + i} with a lamp of #{i * 7} wicks."
      end)

    first = %{role: "user", content: notes <> " Which of these towers is oldest?"}

    {ttfts, _} =
      Enum.map_reduce(1..4, [%{role: "system", content: @system}, first], fn turn, history ->
        {ttft, _, answer} =
          timed(Cluster.stream_chat(group, history, [max_tokens: 24, temp: 0.0] ++ opts))

        history =
          history ++
            [
              %{role: "assistant", content: answer},
              %{role: "user", content: "Question #{turn + 1}: and tower #{c + turn}?"}
            ]

        {ttft, history}
      end)

    ttfts
  end
end

model = System.get_env("LLAMA_MODEL_PATH") || raise "set LLAMA_MODEL_PATH"
threads = String.to_integer(System.get_env("LLAMA_THREADS", "2"))
IO.puts("# bench/cluster.exs — #{Path.basename(model)}, #{threads} threads in all")
parts = String.split(System.get_env("CLUSTER_PARTS", "scaling,routing"), ",")
if "scaling" in parts, do: Bench.Cluster.scaling(model, threads)
if "routing" in parts, do: Bench.Cluster.routing(model, threads)
