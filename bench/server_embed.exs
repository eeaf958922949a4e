# Embeddings in the Server: Server.embed/3 calls of 32 short sentences, alone and while 4
# streams generate, and what they cost the streams' inter-token latency.
#
#   [LLAMA_MODEL_PATH=model.gguf] [LLAMA_THREADS=2] [EMBED_CHUNK=64] \
#     mix run bench/server_embed.exs
#
# Phases (one server, n_parallel 4, temperature 0, cache_prompt false):
#   1. embeddings alone: calls of 32 sentences back to back -> texts/s, tokens/s, latency;
#   2. generation alone: 4 streams of 128 tokens -> decode tok/s, ITL p50/p90;
#   3. both: the same 4 streams while a client sends embedding calls back to back ->
#      texts/s under load, decode tok/s and ITL of the streams.
# The model route (LlamaCppEx.embed_batch on the same 32 texts, its own context) is printed
# for reference. llama-server cannot do this side by side: with --embeddings it serves
# embeddings only, so the comparison there is two servers competing for the same cores.

alias LlamaCppEx.Server

Code.require_file("support/models.exs", __DIR__)

defmodule Bench.ServerEmbed do
  @calls 6

  def pct([], _), do: 0.0

  def pct(xs, p),
    do: xs |> Enum.sort() |> Enum.at(min(length(xs) - 1, trunc(p / 100 * length(xs))))

  def texts(k) do
    subjects = ~w(cat dog bird fish horse fox owl bee)
    verbs = ~w(sleeps runs sings swims jumps hides watches hums)

    for i <- 1..32,
        do:
          "The #{Enum.at(subjects, rem(i + k, 8))} #{Enum.at(verbs, rem(i * 3, 8))} near house #{i + k} in the quiet town."
  end

  def prompt(i),
    do:
      "Here is a report on topic #{i}. " <>
        String.duplicate("The committee reviewed the budget and the risks. ", 4) <>
        "Write a long summary:"

  # back-to-back calls until `stop?` says so (or @calls of them): [{microseconds, tokens}]
  def embed_loop(s, model, stop?, acc \\ [], k \\ 0) do
    if stop?.(k) do
      Enum.reverse(acc)
    else
      t = texts(k)
      tokens = Enum.sum(for x <- t, do: length(elem(LlamaCppEx.Tokenizer.encode(model, x), 1)))
      {us, {:ok, v}} = :timer.tc(fn -> Server.embed(s, t, timeout: 120_000) end)
      32 = length(v)
      embed_loop(s, model, stop?, [{us, tokens} | acc], k + 1)
    end
  end

  def streams(s, n, max_tokens) do
    1..n
    |> Task.async_stream(
      fn i ->
        times =
          s
          |> Server.stream(prompt(i),
            max_tokens: max_tokens,
            cache_prompt: false,
            timeout: 120_000
          )
          |> Enum.map(fn _ -> System.monotonic_time(:microsecond) end)

        times
      end,
      max_concurrency: n,
      timeout: :infinity
    )
    |> Enum.map(fn {:ok, r} -> r end)
  end

  def decode_stats(results) do
    itl = for ts <- results, [a, b] <- Enum.chunk_every(ts, 2, 1, :discard), do: (b - a) / 1000

    firsts = Enum.map(results, &hd/1)
    lasts = Enum.map(results, &List.last/1)
    span = (Enum.max(lasts) - Enum.max(firsts)) / 1.0e6
    decoded = Enum.sum(for ts <- results, do: length(ts) - 1)
    %{tok_s: decoded / max(span, 1.0e-6), p50: pct(itl, 50), p90: pct(itl, 90)}
  end

  def embed_stats(calls) do
    total_us = Enum.sum(for {us, _} <- calls, do: us)
    tokens = Enum.sum(for {_, t} <- calls, do: t)

    %{
      texts_s: 32 * length(calls) * 1.0e6 / total_us,
      tokens_s: tokens * 1.0e6 / total_us,
      ms: pct(for({us, _} <- calls, do: us / 1000), 50),
      calls: length(calls)
    }
  end

  def run do
    path = Bench.Models.default_path()
    threads = String.to_integer(System.get_env("LLAMA_THREADS", "2"))
    embed_chunk = String.to_integer(System.get_env("EMBED_CHUNK", "64"))

    {s, model} = Bench.Models.start_server(path, n_threads: threads, embed_chunk: embed_chunk)
    IO.puts("model #{Path.basename(path)}, #{threads} threads, embed_chunk #{embed_chunk}")
    Server.embed(s, texts(0))
    Server.generate(s, "warm up", max_tokens: 4)

    {us, {:ok, _}} =
      :timer.tc(fn -> LlamaCppEx.embed_batch(model, texts(0), n_threads: threads) end)

    IO.puts("model route embed_batch(32): #{Float.round(32 * 1.0e6 / us, 1)} texts/s")

    alone = embed_stats(embed_loop(s, model, &(&1 >= @calls)))

    IO.puts(
      "1. embed alone:   #{f(alone.texts_s)} texts/s, #{f(alone.tokens_s)} tok/s, " <>
        "call p50 #{f(alone.ms)} ms"
    )

    gen = decode_stats(streams(s, 4, 128))

    IO.puts(
      "2. 4 streams:     decode #{f(gen.tok_s)} tok/s, ITL p50 #{f(gen.p50)} ms p90 #{f(gen.p90)} ms"
    )

    done = :atomics.new(1, [])

    embedder = Task.async(fn -> embed_loop(s, model, fn _ -> :atomics.get(done, 1) == 1 end) end)

    both = decode_stats(streams(s, 4, 128))
    :atomics.put(done, 1, 1)
    under = embed_stats(Task.await(embedder, :infinity))

    IO.puts(
      "3. both:          decode #{f(both.tok_s)} tok/s, ITL p50 #{f(both.p50)} ms p90 #{f(both.p90)} ms; " <>
        "embed #{f(under.texts_s)} texts/s (#{under.calls} calls, p50 #{f(under.ms)} ms)"
    )

    IO.puts(
      "   ITL p50 x#{f(both.p50 / gen.p50)}, decode x#{f(both.tok_s / gen.tok_s)}, " <>
        "embeddings x#{f(under.texts_s / alone.texts_s)} of alone"
    )

    GenServer.stop(s)
  end

  defp f(x), do: :erlang.float_to_binary(x / 1, decimals: 1)
end

Bench.ServerEmbed.run()
