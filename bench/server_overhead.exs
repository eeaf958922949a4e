# Single-stream decode under the Server against the same engine without it, in one VM.
#
#   [LLAMA_MODEL_PATH=model.gguf] [LLAMA_THREADS=2] [BENCH_ROUNDS=5] mix run bench/server_overhead.exs
#
# Each round decodes the same ~100-token prompt and 128 new tokens twice, alternating:
#
#   * bare: `Context.decode/2` of one token at a time on a context like the Server's (same
#     n_ctx, threads, positions), timed around the NIF call;
#   * server: `Server.stream/3` of the same prompt (temperature 0, prompt cache off); the
#     engine's own time per one-token tick comes from the `:tick` telemetry (`eval_ms`), the
#     inter-token latency from the stream;
#   * the same on a second server with `overlap: false` (each step waits for the server's
#     turn after the one before).
#
# Alternating rounds keep a shared machine's drift out of the comparison. Prints per-round
# medians with the ratios server/bare, then each column's median over rounds (the ratios'
# taken over the per-round ratios).

alias LlamaCppEx.{Context, Server, Tokenizer}

Code.require_file("support/tele.exs", __DIR__)

defmodule Bench.Overhead do
  def median([]), do: 0.0
  def median(xs), do: xs |> Enum.sort() |> Enum.at(div(length(xs), 2))

  def bare(ctx, ids, n) do
    Context.clear(ctx)
    :ok = Context.decode(ctx, ids)

    times =
      for i <- 1..n do
        {us, :ok} = :timer.tc(fn -> Context.decode(ctx, [100 + i]) end)
        us / 1000
      end

    median(times)
  end

  def server(s, prompt, n) do
    Bench.Tele.collect_ticks()
    :persistent_term.put(:bench_telemetry, self())

    stamps =
      s
      |> Server.stream(prompt, max_tokens: n, timeout: 120_000)
      |> Enum.map(fn _ -> System.monotonic_time(:microsecond) end)

    :persistent_term.erase(:bench_telemetry)
    evals = for {1, ms} <- Bench.Tele.collect_ticks(), do: ms

    itl = stamps |> Enum.chunk_every(2, 1, :discard) |> Enum.map(fn [a, b] -> (b - a) / 1000 end)

    {median(evals), median(itl)}
  end
end

Bench.Tele.install()

path =
  System.get_env("LLAMA_MODEL_PATH") ||
    Path.join(System.user_home!(), ".cache/llama_cpp_ex/models/SmolLM2-135M-Instruct.Q4_1.gguf")

threads = String.to_integer(System.get_env("LLAMA_THREADS") || "#{System.schedulers_online()}")
rounds = String.to_integer(System.get_env("BENCH_ROUNDS") || "5")
n = 128
n_ctx = 1024

prompt =
  "Here is a report on the committee. " <>
    String.duplicate("The committee reviewed the budget, the schedule and the risks. ", 8)

{:ok, model} = LlamaCppEx.load_model(path)
{:ok, ids} = Tokenizer.encode(model, prompt)
{:ok, ctx} = Context.create(model, n_ctx: n_ctx, n_threads: threads)

start = fn overlap ->
  {:ok, s} =
    Server.start_link(
      model_path: path,
      n_parallel: 1,
      n_ctx: n_ctx,
      n_threads: threads,
      temp: 0.0,
      cache_prompt: false,
      overlap: overlap
    )

  Server.generate(s, "warm up", max_tokens: 4)
  s
end

{s, s_off} = {start.(true), start.(false)}
Bench.Overhead.bare(ctx, ids, 8)

IO.puts(
  "model: #{Path.basename(path)}, threads: #{threads}, prompt #{length(ids)} tokens, #{n} new\n"
)

IO.puts(
  "| round | bare decode p50 ms | server eval p50 ms | server ITL p50 ms | " <>
    "ITL p50 ms, overlap off | eval/bare | ITL/bare | ITL off/bare |"
)

IO.puts("|---:|---:|---:|---:|---:|---:|---:|---:|")
r = fn x, y -> :erlang.float_to_binary(x / y, decimals: 2) end
f = fn x -> :erlang.float_to_binary(x / 1, decimals: 2) end

results =
  for round <- 1..rounds do
    b = Bench.Overhead.bare(ctx, ids, n)
    {e, i} = Bench.Overhead.server(s, prompt, n)
    {_, o} = Bench.Overhead.server(s_off, prompt, n)

    IO.puts(
      "| #{round} | #{f.(b)} | #{f.(e)} | #{f.(i)} | #{f.(o)} | #{r.(e, b)} | #{r.(i, b)} | " <>
        "#{r.(o, b)} |"
    )

    {b, e, i, o}
  end

[bs, es, is, os] =
  results |> Enum.map(&Tuple.to_list/1) |> Enum.zip() |> Enum.map(&Tuple.to_list/1)

# the machine drifts between rounds: alternation keeps that out of a round's ratio, not out of
# a ratio of two columns' medians
med = &Bench.Overhead.median/1
ratio = fn xs, ys -> xs |> Enum.zip(ys) |> Enum.map(fn {x, y} -> x / y end) |> med.() end

IO.puts(
  "| median | #{f.(med.(bs))} | #{f.(med.(es))} | #{f.(med.(is))} | #{f.(med.(os))} | " <>
    "#{f.(ratio.(es, bs))} | #{f.(ratio.(is, bs))} | #{f.(ratio.(os, bs))} |"
)

GenServer.stop(s)
GenServer.stop(s_off)
