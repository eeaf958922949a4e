# Embedding throughput: embed_batch of 1, 8, 32 and 128 short texts (one forward pass each).
#
#   [LLAMA_MODEL_PATH=model.gguf | checkpoint dir] [LLAMA_THREADS=2] \
#     [LLAMA_CPP_BIN=/path/to/llama.cpp/bin] mix run bench/embeddings.exs
#
# Default model: SmolLM2 (mean pooling). With LLAMA_CPP_BIN set and a GGUF model, runs
# `llama-embedding` on the same texts (one process per batch size; its time is the wall time
# minus that of a one-word run, i.e. without load) and prints its tokens/s beside ours. A Hugging Face
# directory (e.g. all-MiniLM-L6-v2) runs ours only.

alias LlamaCppEx.{Model, Tokenizer}

defmodule Bench.Embeddings do
  @reps 3

  def median(xs), do: xs |> Enum.sort() |> Enum.at(div(length(xs), 2))

  def texts(n) do
    subjects = ~w(cat dog bird fish horse fox owl bee)
    verbs = ~w(sleeps runs sings swims jumps hides watches hums)

    for i <- 1..n,
        do:
          "The #{Enum.at(subjects, rem(i, 8))} #{Enum.at(verbs, rem(i * 3, 8))} near house #{i} in the quiet town."
  end

  def ours(model, texts, threads) do
    {:ok, _} = LlamaCppEx.embed_batch(model, texts, n_threads: threads)

    times =
      for _ <- 1..@reps do
        {us, {:ok, _}} =
          :timer.tc(fn -> LlamaCppEx.embed_batch(model, texts, n_threads: threads) end)

        us
      end

    median(times) / 1.0e6
  end

  # llama-embedding's own --perf timing is wrong once the texts span several sequences'
  # batches, so its time is the process's wall time minus that of a one-word run (load,
  # warm-up and exit cost the same in both), median of three each.
  def llama_cpp(bin, path, texts, threads) do
    run = fn prompt ->
      args = ["-m", path, "-p", prompt, "-t", "#{threads}", "--pooling", "mean", "-c", "8192"]
      args = args ++ ["-b", "8192", "-ub", "8192"]

      times =
        for _ <- 1..@reps do
          {us, {_, 0}} =
            :timer.tc(fn ->
              System.cmd(Path.join(bin, "llama-embedding"), args,
                stderr_to_stdout: true,
                env: Bench.LlamaCpp.env(bin)
              )
            end)

          us
        end

      median(times) / 1.0e6
    end

    max(run.(Enum.join(texts, "\n")) - run.("a"), 1.0e-6)
  end
end

Code.require_file("support/models.exs", __DIR__)
Code.require_file("support/llama_cpp.exs", __DIR__)
path = Bench.Models.default_path()

threads = String.to_integer(System.get_env("LLAMA_THREADS", "2"))
bin = System.get_env("LLAMA_CPP_BIN")
{:ok, model} = LlamaCppEx.load_model(path, quantize: :none)
IO.puts("model: #{Model.desc(model)} (#{path}), #{threads} threads")

IO.puts("| texts | tokens | ours s | texts/s | tokens/s | llama-embedding tokens/s | ratio |")
IO.puts("|---:|---:|---:|---:|---:|---:|---:|")

for n <- [1, 8, 32, 128] do
  texts = Bench.Embeddings.texts(n)

  tokens =
    texts |> Enum.map(fn t -> length(elem(Tokenizer.encode(model, t), 1)) end) |> Enum.sum()

  s = Bench.Embeddings.ours(model, texts, threads)

  theirs =
    if bin && File.regular?(path), do: Bench.Embeddings.llama_cpp(bin, path, texts, threads)

  {their_tps, ratio} =
    case theirs do
      ts when is_float(ts) ->
        {Float.round(tokens / ts, 1), Float.round(ts / s, 2)}

      nil ->
        {"-", "-"}
    end

  IO.puts(
    "| #{n} | #{tokens} | #{Float.round(s, 4)} | #{Float.round(n / s, 1)} | #{Float.round(tokens / s, 1)} | #{their_tps} | #{ratio} |"
  )
end
