defmodule LlamaCppEx.Hostile do
  @moduledoc false
  # Runs a piece of code in a fresh OS process (a new BEAM with this project's code paths), so
  # that a segfault, an abort or a hang is a test failure and not a dead test runner.
  #
  # The code is the body of a function; its value comes back as
  # `{:ok, %{ms: elapsed, value: term}}`, or `{:ok, %{ms: elapsed, raised: {module, message}}}`
  # when it raises. A VM that dies is `{:crashed, exit_status, output}`; one that runs past
  # `:limit_ms` is killed and reported as `{:timeout, output}`.

  @marker "__HOSTILE_RESULT__"

  @spec run(String.t(), keyword()) ::
          {:ok, map()} | {:crashed, integer(), String.t()} | {:timeout, String.t()}
  def run(body, opts \\ []) do
    limit = Keyword.get(opts, :limit_ms, 60_000)

    dir =
      Path.join(System.tmp_dir!(), "llama_cpp_ex_hostile_#{System.unique_integer([:positive])}")

    File.mkdir_p!(dir)
    script = Path.join(dir, "case.exs")
    File.write!(script, wrap(body))

    elixir = System.find_executable("elixir") || raise "elixir is not on PATH"
    paths = Enum.flat_map(project_paths(), &["-pa", &1])
    # Two schedulers like the machines we run on; the child shares the runner's cores.
    args = ["--erl", "+S 2:2"] ++ paths ++ [script]

    port =
      Port.open({:spawn_executable, elixir}, [
        :binary,
        :exit_status,
        :stderr_to_stdout,
        args: args,
        env: [{~c"MIX_ENV", ~c"test"}]
      ])

    {:os_pid, os_pid} = Port.info(port, :os_pid)
    deadline = System.monotonic_time(:millisecond) + limit
    result = collect(port, os_pid, deadline, [])
    File.rm_rf(dir)
    result
  end

  defp collect(port, os_pid, deadline, acc) do
    left = max(deadline - System.monotonic_time(:millisecond), 0)

    receive do
      {^port, {:data, data}} ->
        collect(port, os_pid, deadline, [acc, data])

      {^port, {:exit_status, status}} ->
        output = IO.iodata_to_binary(acc)
        decode(status, output)
    after
      left ->
        System.cmd("kill", ["-9", Integer.to_string(os_pid)])
        {:timeout, IO.iodata_to_binary(acc)}
    end
  end

  defp decode(0, output) do
    case String.split(output, @marker) do
      [_, encoded | _] ->
        {:ok, encoded |> String.trim() |> Base.decode64!() |> :erlang.binary_to_term()}

      _ ->
        {:crashed, 0, output}
    end
  end

  defp decode(status, output), do: {:crashed, status, output}

  defp project_paths do
    build = Mix.Project.build_path()

    :code.get_path()
    |> Enum.map(&List.to_string/1)
    |> Enum.filter(&String.starts_with?(&1, build))
  end

  defp wrap(body) do
    """
    {:ok, _} = Application.ensure_all_started(:llama_cpp_ex)
    Logger.configure(level: :error)
    t0 = System.monotonic_time(:millisecond)

    outcome =
      try do
        value = (fn ->
    #{body}
        end).()
        %{value: value}
      rescue
        e -> %{raised: {e.__struct__, Exception.message(e)}}
      end

    ms = System.monotonic_time(:millisecond) - t0
    encoded = Base.encode64(:erlang.term_to_binary(Map.put(outcome, :ms, ms)))
    IO.puts("\\n#{@marker}" <> encoded)
    System.halt(0)
    """
  end
end
