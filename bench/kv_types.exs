# Decode speed and KV memory per cache type (f16, q8_0, q4_0) on one model, model route:
# a ~500-token prompt, then 128 greedy tokens; median of 3. Then sequences served at once in
# a Server with a fixed KV budget in bytes, per fixed type and under the pressure policy
# (`kv_policy: []`: f16 blocks until the cache is 80% full, then q8_0, then q4_0 at 95%).
#
#   [LLAMA_MODEL_PATH=model.gguf] [LLAMA_THREADS=2] mix run bench/kv_types.exs

Code.require_file("support/models.exs", __DIR__)
path = Bench.Models.default_path()
threads = String.to_integer(System.get_env("LLAMA_THREADS", "2"))
{:ok, model} = LlamaCppEx.load_model(path)
info = LlamaCppEx.Model.info(model)
prompt = String.duplicate("The committee reviewed the budget, the schedule and the risks. ", 40)
median = fn xs -> xs |> Enum.sort() |> Enum.at(div(length(xs), 2)) end

run = fn type, max ->
  median.(
    for _ <- 1..3 do
      {us, {:ok, _}} =
        :timer.tc(fn ->
          LlamaCppEx.generate(model, prompt,
            max_tokens: max,
            temp: 0.0,
            n_threads: threads,
            n_ctx: 1024,
            type_k: type,
            type_v: type
          )
        end)

      us / 1000
    end
  )
end

# bytes per cached token: K and V rows of every layer
head_row = div(info.n_embd, info.n_head) * info.n_head_kv
bytes = %{f16: 2.0, q8_0: 34 / 32, q4_0: 18 / 32}

IO.puts("model #{Path.basename(path)}, #{threads} threads")
IO.puts("| KV type | bytes / token | decode ms (128 tok, after a 500-token prompt) | tok/s |")
IO.puts("|---|---:|---:|---:|")

# BENCH_SKIP_DECODE=1 goes straight to the Server tables
decode_types = if System.get_env("BENCH_SKIP_DECODE"), do: [], else: [:f16, :q8_0, :q4_0]

for type <- decode_types do
  prefill = run.(type, 1)
  total = run.(type, 129)
  decode = total - prefill
  per_token = round(2 * info.n_layer * head_row * bytes[type])

  IO.puts(
    "| #{type} | #{per_token} | #{Float.round(decode, 1)} | #{Float.round(128_000 / decode, 1)} |"
  )
end

# Sequences served concurrently at a fixed KV budget: a Server with kv_budget_mb: 8 and 8
# slots, 8 requests of a ~250-token prompt and 64 new tokens at once; the most requests
# active together (get_stats polled every 10 ms) and the wall time.
alias LlamaCppEx.Server

IO.puts(
  "\n| KV type (8 MiB budget, 8 × (~250 + 64) tokens) | n_ctx | most active at once | completed | :context_full | wall s | precision changes | final precision |"
)

IO.puts("|---|---:|---:|---:|---:|---:|---:|---|")
long = String.duplicate("The committee reviewed the budget, the schedule and the risks. ", 20)

# 8 requests at once: {wall µs, completed, failed with :context_full}
serve_eight = fn s, prompt, opts ->
  {us, results} =
    :timer.tc(fn ->
      1..8
      |> Enum.map(fn i ->
        Task.async(fn -> Server.generate(s, prompt.(i), [timeout: 600_000] ++ opts) end)
      end)
      |> Task.await_many(600_000)
    end)

  {us, Enum.count(results, &match?({:ok, _}, &1)),
   Enum.count(results, &match?({:error, :context_full}, &1))}
end

configs = [
  {"f16", [type_k: :f16, type_v: :f16]},
  {"q8_0", [type_k: :q8_0, type_v: :q8_0]},
  {"q4_0", [type_k: :q4_0, type_v: :q4_0]},
  {"kv_policy: [] (f16 → q8_0 → q4_0)", [kv_policy: []]},
  {"kv_policy: [q8_threshold: 0.5, q4_threshold: 0.7, ewma_alpha: 0.5]",
   [kv_policy: [q8_threshold: 0.5, q4_threshold: 0.7, ewma_alpha: 0.5]]}
]

for {label, kv_opts} <- configs do
  {s, _} =
    Bench.Models.start_server(
      path,
      [n_threads: threads, n_parallel: 8, kv_budget_mb: 8] ++ kv_opts
    )

  parent = self()

  poller =
    spawn(fn ->
      loop = fn loop, best ->
        receive do
          :stop -> send(parent, {:best, best})
        after
          10 -> loop.(loop, max(best, Server.get_stats(s).active_slots))
        end
      end

      loop.(loop, 0)
    end)

  {us, done, full} = serve_eight.(s, &"#{&1}. #{long}", max_tokens: 64)

  send(poller, :stop)
  best = receive do: ({:best, b} -> b)
  stats = Server.get_stats(s)

  IO.puts(
    "| #{label} | #{stats.n_ctx} | #{best} | #{done} | #{full} | #{Float.round(us / 1.0e6, 1)} | " <>
      "#{Map.get(stats, :kv_precision_changes, "-")} | #{Map.get(stats, :kv_precision, "-")} |"
  )

  GenServer.stop(s)
end

# Sequences that grow into the budget: 8 requests of a short prompt and 160 new tokens at
# once (all admitted, since the prompts fit), 8 MiB budget. Fixed f16 runs out of blocks
# mid-answer (idle caches are purged first, then requests fail with :context_full); the
# policy writes the later blocks smaller.
IO.puts(
  "\n| KV type (8 MiB budget, 8 × (~15 + 160) tokens) | completed | :context_full | wall s | precision changes | final precision |"
)

IO.puts("|---|---:|---:|---:|---:|---|")

for {label, kv_opts} <- configs do
  {s, m} =
    Bench.Models.start_server(
      path,
      [n_threads: threads, n_parallel: 8, kv_budget_mb: 8] ++ kv_opts
    )

  # every end-of-generation token banned, so each answer is 160 tokens long
  no_eos =
    for t <- 0..(LlamaCppEx.Tokenizer.vocab_size(m) - 1),
        LlamaCppEx.Tokenizer.eog?(m, t),
        into: %{},
        do: {t, :neg_infinity}

  {us, done, full} =
    serve_eight.(s, &"Story #{&1}: once upon a time, a dragon called Bob",
      max_tokens: 160,
      logit_bias: no_eos
    )

  stats = Server.get_stats(s)

  IO.puts(
    "| #{label} | #{done} | #{full} | #{Float.round(us / 1.0e6, 1)} | " <>
      "#{Map.get(stats, :kv_precision_changes, "-")} | #{Map.get(stats, :kv_precision, "-")} |"
  )

  GenServer.stop(s)
end
