# Single-stream speed: load time, prompt processing (pp128, pp512) and decode (tg128).
#
#   LLAMA_MODEL_PATH=path/to/model.gguf [LLAMA_THREADS=2] [LLAMA_CPP_BIN=/path/to/llama.cpp/bin] \
#     mix run bench/generate.exs
#
# Prompt processing evaluates N tokens in one batch; decode evaluates 128 tokens one at a time
# after a one-token prompt (llama-bench's pp/tg definitions); `generate` is decode through
# `LlamaCppEx.generate/3` (the model route, sampling included: greedy, and "generate, sampled"
# with llama.cpp's default chain, temperature 0.8, top-k 40, top-p 0.95, min-p 0.05). With
# LLAMA_CPP_BIN set, runs `llama-bench -t N -p 128,512 -n 128` on the same file and prints
# our/their ratios.
# LLAMA_CPP_BIN_AVX2 adds the same columns for a llama.cpp built for AVX2 only
# (`GGML_NATIVE=OFF GGML_AVX512=OFF`: what llama.cpp runs on an AVX2-only CPU), for runs of
# our AVX2 path on an AVX-512 machine (bench/simd_levels.sh sets it for its avx2 rows).

Code.require_file("support/llama_cpp.exs", __DIR__)

alias LlamaCppEx.{Context, Model, NIF}

defmodule Bench.Generate do
  @reps 3

  def median(xs), do: xs |> Enum.sort() |> Enum.at(div(length(xs), 2))

  def time_ms(fun) do
    {us, _} = :timer.tc(fun)
    us / 1000
  end

  def prompt_tps(model, n, threads) do
    vocab = LlamaCppEx.Tokenizer.vocab_size(model)
    tokens = Enum.map(1..n, &(rem(&1 * 7919 + 13, vocab - 100) + 50))
    {:ok, ctx} = Context.create(model, n_ctx: n + 16, n_batch: n, n_threads: threads)
    # warm-up
    :ok = Context.decode(ctx, Enum.take(tokens, 8))

    times =
      for _ <- 1..@reps do
        Context.clear(ctx)
        time_ms(fn -> :ok = Context.decode(ctx, tokens) end)
      end

    n / (median(times) / 1000)
  end

  def decode_tps(model, n, threads) do
    {:ok, ctx} = Context.create(model, n_ctx: n + 16, n_threads: threads)
    # token ids inside any vocabulary (tiny test models have ~100)
    vocab = LlamaCppEx.Tokenizer.vocab_size(model)

    times =
      for _ <- 1..@reps do
        Context.clear(ctx)
        :ok = Context.decode(ctx, [1])

        time_ms(fn -> for i <- 1..n, do: :ok = NIF.decode(ctx.ref, [rem(i * 31 + 100, vocab)]) end)
      end

    n / (median(times) / 1000)
  end

  # Decode through the model route (`LlamaCppEx.generate/3`: engine steps driven from the
  # caller, sampling included): 127 tokens after the first, every end-of-generation token
  # banned so each run generates them all. `sampling`: greedy, or llama.cpp's default chain.
  def generate_tps(model, threads, sampling) do
    vocab = LlamaCppEx.Tokenizer.vocab_size(model)
    ban = for id <- 0..(vocab - 1), LlamaCppEx.Tokenizer.eog?(model, id), do: {id, :neg_infinity}
    prompt = "Write a long story about a lighthouse keeper and the sea."

    chain =
      case sampling do
        :greedy -> [temp: 0.0]
        :sampled -> [temp: 0.8, top_k: 40, top_p: 0.95, min_p: 0.05, seed: 1]
      end

    opts = [max_tokens: 128, n_threads: threads, n_ctx: 512, logit_bias: ban] ++ chain

    times =
      for _ <- 1..@reps do
        full = time_ms(fn -> {:ok, _} = LlamaCppEx.generate(model, prompt, opts) end)

        first =
          time_ms(fn ->
            {:ok, _} = LlamaCppEx.generate(model, prompt, Keyword.put(opts, :max_tokens, 1))
          end)

        full - first
      end

    127 / (median(times) / 1000)
  end

  def llama_bench(bin, path, threads) do
    exe = Path.join(bin, "llama-bench")

    if File.exists?(exe) do
      {out, 0} =
        System.cmd(
          exe,
          ["-m", path, "-t", "#{threads}", "-p", "128,512", "-n", "128", "-o", "csv"],
          stderr_to_stdout: false,
          env: Bench.LlamaCpp.env(bin)
        )

      [header | rows] = out |> String.split("\n", trim: true) |> Enum.map(&parse_csv/1)
      idx = fn name -> Enum.find_index(header, &(&1 == name)) end

      Map.new(rows, fn row ->
        p = String.to_integer(Enum.at(row, idx.("n_prompt")))
        g = String.to_integer(Enum.at(row, idx.("n_gen")))
        ts = row |> Enum.at(idx.("avg_ts")) |> Float.parse() |> elem(0)
        {if(g > 0, do: "tg#{g}", else: "pp#{p}"), ts}
      end)
    end
  end

  defp parse_csv(line) do
    line |> String.split(",") |> Enum.map(&String.trim(&1, "\""))
  end
end

path =
  System.get_env("LLAMA_MODEL_PATH") ||
    Path.join(
      Path.join(System.user_home!(), ".cache/llama_cpp_ex/models"),
      "SmolLM2-135M-Instruct.Q4_1.gguf"
    )

threads = String.to_integer(System.get_env("LLAMA_THREADS") || "#{System.schedulers_online()}")

requantize =
  case System.get_env("LLAMA_REQUANTIZE", "1") do
    "0" -> false
    "all" -> :all
    _ -> true
  end

{load_us, {:ok, model}} = :timer.tc(fn -> LlamaCppEx.load_model(path, requantize: requantize) end)

ours = %{
  "pp128" => Bench.Generate.prompt_tps(model, 128, threads),
  "pp512" => Bench.Generate.prompt_tps(model, 512, threads),
  "tg128" => Bench.Generate.decode_tps(model, 128, threads),
  "generate" => Bench.Generate.generate_tps(model, threads, :greedy),
  "generate, sampled" => Bench.Generate.generate_tps(model, threads, :sampled)
}

IO.puts(
  "model: #{Model.desc(model)} (#{Path.basename(path)}), threads: #{threads}, requantize: #{requantize}"
)

IO.puts("load: #{Float.round(load_us / 1000, 1)} ms")

# one column pair per llama.cpp build given (an empty pair when none is)
comparisons =
  for {var, label} <- [
        {"LLAMA_CPP_BIN", "llama.cpp"},
        {"LLAMA_CPP_BIN_AVX2", "llama.cpp AVX2 build"}
      ],
      bin = System.get_env(var),
      bin not in [nil, ""],
      do: {label, Bench.Generate.llama_bench(bin, path, threads)}

comparisons = if comparisons == [], do: [{"llama.cpp", nil}], else: comparisons

IO.puts(
  "\n| test  | LlamaCppEx tok/s |" <>
    Enum.map_join(comparisons, fn {label, _} -> " #{label} tok/s | ratio |" end)
)

IO.puts(
  "|-------|-----------------:|" <>
    String.duplicate("----------------:|------:|", length(comparisons))
)

for test <- ["pp128", "pp512", "tg128", "generate", "generate, sampled"] do
  ours_v = ours[test]

  cells =
    Enum.map_join(comparisons, fn {_, results} ->
      case results && results[test] do
        nil ->
          " - | - |"

        theirs_v ->
          " #{:erlang.float_to_binary(theirs_v, decimals: 1)} | " <>
            "#{:erlang.float_to_binary(ours_v / theirs_v, decimals: 2)} |"
      end
    end)

  IO.puts("| #{test} | #{:erlang.float_to_binary(ours_v, decimals: 1)} |" <> cells)
end

# Decode reads every weight once per token: weight bytes × tok/s is the bandwidth decode
# uses, compared with the machine's read bandwidth at the same thread count (measured by the
# engine's llama_cpp_ex_membw, a streaming read over 1 GiB).
membw =
  case System.cmd(
         "cargo",
         ~w(run --release -q --manifest-path native/Cargo.toml -p llama_cpp_ex_engine
            --bin llama_cpp_ex_membw -- #{threads} 1024),
         stderr_to_stdout: true
       ) do
    {out, 0} ->
      out |> String.split() |> List.last() |> Float.parse() |> elem(0)

    {out, _} ->
      IO.puts("(read bandwidth not measured: #{String.slice(out, 0, 200)})")
      nil
  end

weights_gb = Model.size(model) / 1.0e9
used = weights_gb * ours["tg128"]

IO.puts(
  "\ndecode: #{Float.round(weights_gb * 1000, 1)} MB of weights per token × " <>
    "#{Float.round(ours["tg128"], 1)} tok/s = #{Float.round(used, 2)} GB/s" <>
    if(membw,
      do:
        " of #{Float.round(membw, 2)} GB/s read bandwidth with #{threads} threads " <>
          "(#{round(100 * used / membw)}% of the ceiling #{Float.round(membw / weights_gb, 1)} tok/s)",
      else: ""
    )
)
