# Decode under the Server with `overlap: true` (the default: the next decode step is queued
# behind the running one) against `overlap: false` (each step waits for the server's turn
# after the one before), alternated in one VM.
#
#   [LLAMA_MODEL_PATH=model.gguf] [LLAMA_THREADS=2] [BENCH_STREAMS=1] [BENCH_ROUNDS=10] \
#     mix run bench/server_overlap.exs
#
# Two servers (n_parallel = BENCH_STREAMS, prompt cache off, temperature 0, end-of-generation
# tokens banned) take turns, the order flipped every round; each round streams BENCH_STREAMS
# ~90-token prompts to 128 new tokens at once. Decode tok/s: the tokens that arrived while every
# stream was decoding (after the latest first token, up to the earliest last) over that span.
# Prints each round's figures, their medians and the median of the per-round ratios.

alias LlamaCppEx.{Server, Tokenizer}

defmodule Bench.Overlap do
  def median(xs), do: xs |> Enum.sort() |> Enum.at(div(length(xs), 2))

  def start(path, streams, threads, overlap) do
    {:ok, s} =
      Server.start_link(
        model_path: path,
        n_parallel: streams,
        n_ctx: streams * 512,
        n_threads: threads,
        temp: 0.0,
        cache_prompt: false,
        overlap: overlap
      )

    Server.generate(s, "warm up", max_tokens: 4)
    s
  end

  def decode_tps(s, streams, ban) do
    stamps =
      1..streams
      |> Enum.map(fn i ->
        Task.async(fn ->
          s
          |> Server.stream(prompt(i), max_tokens: 128, logit_bias: ban, timeout: 120_000)
          |> Enum.map(fn _ -> System.monotonic_time(:microsecond) end)
        end)
      end)
      |> Task.await_many(300_000)

    from = stamps |> Enum.map(&hd/1) |> Enum.max()
    to = stamps |> Enum.map(&List.last/1) |> Enum.min()
    n = stamps |> List.flatten() |> Enum.count(&(&1 > from and &1 <= to))
    n / ((to - from) / 1.0e6)
  end

  defp prompt(i),
    do: "Report #{i}. " <> String.duplicate("The lighthouse keeper watched the sea. ", 10)
end

path =
  System.get_env("LLAMA_MODEL_PATH") ||
    Path.join(System.user_home!(), ".cache/llama_cpp_ex/models/SmolLM2-135M-Instruct.Q4_1.gguf")

threads = String.to_integer(System.get_env("LLAMA_THREADS") || "#{System.schedulers_online()}")
streams = String.to_integer(System.get_env("BENCH_STREAMS") || "1")
rounds = String.to_integer(System.get_env("BENCH_ROUNDS") || "10")

on = Bench.Overlap.start(path, streams, threads, true)
off = Bench.Overlap.start(path, streams, threads, false)
{:ok, model} = Server.fetch_model(on)
vocab = Tokenizer.vocab_size(model)
ban = for id <- 0..(vocab - 1), Tokenizer.eog?(model, id), into: %{}, do: {id, :neg_infinity}

IO.puts("model: #{Path.basename(path)}, threads: #{threads}, #{streams} streams of 128 tokens\n")
IO.puts("| round | overlap on, decode tok/s | overlap off | on/off |")
IO.puts("|---:|---:|---:|---:|")
f = fn x -> :erlang.float_to_binary(x / 1, decimals: 1) end

results =
  for round <- 1..rounds do
    order = if rem(round, 2) == 0, do: [on, off], else: [off, on]
    got = Map.new(order, fn s -> {s, Bench.Overlap.decode_tps(s, streams, ban)} end)
    {a, b} = {got[on], got[off]}
    IO.puts("| #{round} | #{f.(a)} | #{f.(b)} | #{:erlang.float_to_binary(a / b, decimals: 3)} |")
    {a, b}
  end

{as, bs} = Enum.unzip(results)
ratio = results |> Enum.map(fn {a, b} -> a / b end) |> Bench.Overlap.median()

IO.puts(
  "| median | #{f.(Bench.Overlap.median(as))} | #{f.(Bench.Overlap.median(bs))} | " <>
    "#{:erlang.float_to_binary(ratio, decimals: 3)} |"
)

GenServer.stop(on)
GenServer.stop(off)
