# Prompt-lookup speculative decoding on the model route: an extraction workload (copy a
# ~110-token paragraph) where drafts hit, and a poem where they rarely do; greedy, 128 tokens,
# median of 3. Decode time = the request's time minus a max_tokens: 1 request's (prefill).
# Then the same workload through a Server at 1 and 4 concurrent streams.
#
#   [LLAMA_MODEL_PATH=model.gguf] [LLAMA_THREADS=2] mix run bench/speculative.exs

Code.require_file("support/models.exs", __DIR__)
path = Bench.Models.default_path()

threads = String.to_integer(System.get_env("LLAMA_THREADS", "2"))
{:ok, model} = LlamaCppEx.load_model(path)

paragraph =
  "The committee met on Tuesday to review the budget for the new library. After a long " <>
    "discussion, the members agreed to fund the children's reading room, to extend the opening " <>
    "hours on weekends, and to replace the old heating system before winter. The treasurer noted " <>
    "that the reserve fund would cover most of the cost, and the rest would come from a small " <>
    "increase in membership fees. The chair thanked the volunteers who had organised the book " <>
    "sale in the spring, which raised more than expected."

workloads = [
  {"extraction (copy a paragraph)",
   [%{role: "user", content: "Repeat this text exactly:\n" <> paragraph}]},
  {"no hits (a poem)", [%{role: "user", content: "Write a short poem about the sea."}]}
]

median = fn xs -> xs |> Enum.sort() |> Enum.at(div(length(xs), 2)) end

time = fn msgs, opts ->
  median.(
    for _ <- 1..3 do
      {us, {:ok, _}} =
        :timer.tc(fn -> LlamaCppEx.chat(model, msgs, [temp: 0.0, n_threads: threads] ++ opts) end)

      us / 1000
    end
  )
end

IO.puts("model: #{LlamaCppEx.Model.desc(model)}, #{threads} threads")
IO.puts("| workload | tokens | plain decode ms | speculative decode ms | speedup |")
IO.puts("|---|---:|---:|---:|---:|")

for {label, msgs} <- workloads do
  _ = time.(msgs, max_tokens: 8)
  prefill = time.(msgs, max_tokens: 1)
  {:ok, text} = LlamaCppEx.chat(model, msgs, max_tokens: 128, temp: 0.0)
  {:ok, ids} = LlamaCppEx.Tokenizer.encode(model, text, add_special: false)
  plain = time.(msgs, max_tokens: 128) - prefill
  spec = time.(msgs, max_tokens: 128, speculative: [mode: :prompt_lookup, n_draft: 8]) - prefill

  IO.puts(
    "| #{label} | #{length(ids)} | #{Float.round(plain, 1)} | #{Float.round(spec, 1)} | #{Float.round(plain / spec, 2)} |"
  )
end

# The same in a Server: drafts are extra rows of each tick's forward pass, next to the other
# streams' decode rows. Extraction workload, 128 tokens, 1 and 4 concurrent streams.
alias LlamaCppEx.Server

{server, _} = Bench.Models.start_server(path, n_threads: threads)

{:ok, prompt} = LlamaCppEx.Chat.apply_template(model, elem(hd(workloads), 1))
{:ok, prompt_ids} = LlamaCppEx.Tokenizer.encode(model, prompt)
Server.generate(server, prompt, max_tokens: 4)

server_run = fn n, opts ->
  :ok = Server.reset_stats_window(server)
  before = Server.get_stats(server)

  {us, results} =
    :timer.tc(fn ->
      1..n
      |> Enum.map(fn _ ->
        Task.async(fn -> Server.complete_tokens(server, prompt_ids, opts) end)
      end)
      |> Task.await_many(120_000)
    end)

  after_ = Server.get_stats(server)
  tokens = Enum.sum(for {:ok, r} <- results, do: r.completion_tokens)
  drafted = after_.speculative_drafted - before.speculative_drafted
  accepted = after_.speculative_accepted - before.speculative_accepted
  {tokens * 1.0e6 / us, if(drafted > 0, do: accepted / drafted, else: 0.0)}
end

IO.puts("\nServer (extraction, 128 tokens, wall-clock tok/s including prefill):")
IO.puts("| streams | plain tok/s | speculative tok/s | speedup | acceptance |")
IO.puts("|---:|---:|---:|---:|---:|")

for n <- [1, 4] do
  {plain, _} = server_run.(n, max_tokens: 128)
  {spec, acc} = server_run.(n, max_tokens: 128, speculative: [n_draft: 8])

  IO.puts(
    "| #{n} | #{Float.round(plain, 1)} | #{Float.round(spec, 1)} | #{Float.round(spec / plain, 2)} | #{Float.round(acc, 2)} |"
  )
end

GenServer.stop(server)

# Draft-model speculation. The pair this machine has shares a vocabulary but not a size:
# the target is the same model re-quantized to Q8_0 (`requantize: :all`), the draft its own
# file, so the draft costs about as much per token as the target and no speedup is expected;
# what this measures is acceptance and the cost per emitted token (draft passes + one target
# verification pass), which tells what a draft k times cheaper would give.
alias LlamaCppEx.{Generation, Stepper}

{:ok, target} = LlamaCppEx.load_model(path, requantize: :all)

run_local = fn m, msgs, opts ->
  {:ok, prompt} = LlamaCppEx.Chat.apply_template(m, msgs)
  opts = Generation.options!([temp: 0.0, n_threads: threads] ++ opts, :model)
  {:ok, gen} = Generation.prepare(m, prompt, opts, :model)
  {:ok, s} = Stepper.start(gen, Keyword.take(opts, [:n_threads]))

  loop = fn loop, s, passes ->
    case Stepper.step(s) do
      {:cont, _, s} -> loop.(loop, s, passes + 1)
      {:done, _, s} -> {s, passes + 1}
    end
  end

  {us, {s, passes}} = :timer.tc(fn -> loop.(loop, s, 0) end)
  {us / 1000, s, passes}
end

decode = fn m, msgs, opts ->
  runs =
    for _ <- 1..3 do
      {full, s, passes} = run_local.(m, msgs, [max_tokens: 128] ++ opts)
      {prefill, _, _} = run_local.(m, msgs, [max_tokens: 1] ++ opts)
      {full - prefill, s, passes}
    end

  Enum.sort_by(runs, &elem(&1, 0)) |> Enum.at(1)
end

IO.puts(
  "\nDraft model (target #{LlamaCppEx.Model.desc(target)} re-quantized to Q8_0, draft: the file itself, n_draft 4, 128 greedy tokens):"
)

IO.puts(
  "| workload | tokens | target decode ms/token | draft decode ms/token | speculative ms/token | tokens per target pass | acceptance |"
)

IO.puts("|---|---:|---:|---:|---:|---:|---:|")

for {label, msgs} <- workloads do
  {plain, s0, _} = decode.(target, msgs, [])
  {draft_only, d0, _} = decode.(model, msgs, [])
  {spec, s, passes} = decode.(target, msgs, speculative: [mode: :draft, draft_model: model])
  n = Stepper.generated(s0)
  {drafted, accepted} = Stepper.speculation(s)
  # passes counted over the whole run: the prompt step(s) are not decode passes
  decode_passes = max(passes - 1, 1)

  IO.puts(
    "| #{label} | #{n} | #{Float.round(plain / n, 2)} | #{Float.round(draft_only / Stepper.generated(d0), 2)} | " <>
      "#{Float.round(spec / Stepper.generated(s), 2)} | #{Float.round(Stepper.generated(s) / decode_passes, 2)} | " <>
      "#{Float.round(accepted / max(drafted, 1), 2)} |"
  )
end
