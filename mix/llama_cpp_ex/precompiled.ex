defmodule LlamaCppEx.Precompiled do
  @moduledoc false
  # Precompiled NIF artifacts, the rustler_precompiled convention without the dependency
  # (Hex is not a dependency source here). Loaded by mix.exs, so it runs before the
  # project's own modules are compiled: it may use OTP and Elixir only.
  #
  # An artifact is `llama_cpp_ex-v<version>-nif-<nif>-<target>[-<variant>].tar.gz` holding
  # the NIF and the template-render helper at its top level. The package ships
  # `checksum-Elixir.LlamaCppEx.NIF.exs` (artifact name => "sha256:<hex>"); an artifact is
  # installed only after its SHA-256 matches that file and every archive entry has been
  # checked to stay inside the folder it unpacks into.

  @checksum_file "checksum-Elixir.LlamaCppEx.NIF.exs"
  @files ["llama_cpp_ex_nif.so", "llama_cpp_ex_render"]
  @stamp ".artifact"
  # What a release publishes: the targets and NIF versions `mix llama_cpp_ex.release` builds.
  @targets ["x86_64-unknown-linux-gnu", "aarch64-unknown-linux-gnu"]
  @nif_versions ["2.16"]

  def checksum_file, do: @checksum_file
  def files, do: @files
  def targets, do: @targets
  def nif_versions, do: @nif_versions

  @doc "The release page artifacts are downloaded from unless LLAMA_CPP_EX_BASE_URL is set."
  def default_base_url(version),
    do: "https://github.com/llama-cpp-ex/llama_cpp_ex/releases/download/v#{version}"

  def artifact_name(version, nif_version, target, variant) do
    suffix = if variant in [nil, ""], do: "", else: "-" <> variant
    "llama_cpp_ex-v#{version}-nif-#{nif_version}-#{target}#{suffix}.tar.gz"
  end

  @doc """
  The Rust target triple of this VM: `{:ok, triple}` or `{:error, description}`.
  `LLAMA_CPP_EX_TARGET` overrides it.
  """
  def target(env \\ System.get_env()) do
    case env["LLAMA_CPP_EX_TARGET"] do
      t when is_binary(t) and t != "" -> {:ok, t}
      _ -> system_target(to_string(:erlang.system_info(:system_architecture)))
    end
  end

  defp system_target(arch) do
    {cpu, rest} =
      case String.split(arch, "-", parts: 2) do
        [cpu, rest] -> {cpu, rest}
        [cpu] -> {cpu, ""}
      end

    cpu = if cpu == "arm64", do: "aarch64", else: cpu

    cond do
      rest =~ "linux" and rest =~ "musl" -> {:ok, "#{cpu}-unknown-linux-musl"}
      rest =~ "linux" -> {:ok, "#{cpu}-unknown-linux-gnu"}
      rest =~ "darwin" or rest =~ "apple" -> {:ok, "#{cpu}-apple-darwin"}
      rest =~ "freebsd" -> {:ok, "#{cpu}-unknown-freebsd"}
      true -> {:error, arch}
    end
  end

  @doc "The variant for LLAMA_BACKEND: nil for the CPU build, \"cuda\" for a CUDA one."
  def variant(env \\ System.get_env()) do
    case env["LLAMA_BACKEND"] do
      b when b in [nil, "", "cpu"] -> nil
      other -> other
    end
  end

  @doc """
  `{:ok, %{name => "sha256:<hex>"}}` from the package's checksum file, `:none` when there is
  none (a checkout of the repository), or `{:error, message}`.
  """
  def read_checksums(root) do
    path = Path.join(root, @checksum_file)

    if File.exists?(path) do
      try do
        {map, _} = Code.eval_file(path)
        true = is_map(map)
        {:ok, map}
      rescue
        e -> {:error, "cannot read #{path}: #{Exception.message(e)}"}
      catch
        _, reason -> {:error, "cannot read #{path}: #{inspect(reason)}"}
      end
    else
      :none
    end
  end

  @doc """
  How the NIF is obtained, before anything is fetched:

    * `{:source, :checkout}` — cargo builds it: no checksum file, so a checkout of the
      repository (developers build what they change);
    * `{:source, reason}` — cargo builds it: `LLAMA_CPP_EX_BUILD=1`, or no published
      artifact for this target and variant;
    * `{:precompiled, name, "sha256:<hex>"}`;
    * `{:error, message}` — the package claims an artifact for this target but lacks its
      checksum, or the checksum file cannot be read.

  `opts`: `:root` (the package), `:version`, `:env` (a map, default the OS environment),
  `:nif_version` (default this VM's).
  """
  def decide(opts) do
    env = Keyword.get_lazy(opts, :env, &System.get_env/0)
    root = Keyword.fetch!(opts, :root)
    version = Keyword.fetch!(opts, :version)
    runtime_nif = Keyword.get_lazy(opts, :nif_version, &runtime_nif_version/0)
    variant = variant(env)

    with :ok <- forced_build(env),
         {:ok, checksums} <- checksums_or_source(read_checksums(root)),
         {:ok, target} <- target_or_source(target(env)),
         {:ok, nif} <- nif_or_source(runtime_nif) do
      name = artifact_name(version, nif, target, variant)

      cond do
        target not in @targets or variant != nil ->
          {:source, "no precompiled artifact is published for #{describe(target, variant)}"}

        sha = checksums[name] ->
          {:precompiled, name, sha}

        true ->
          {:error,
           "#{@checksum_file} has no entry for #{name}: the package is incomplete. " <>
             "Reinstall it, or build from source with LLAMA_CPP_EX_BUILD=1 (needs cargo)"}
      end
    end
  end

  defp forced_build(env) do
    if env["LLAMA_CPP_EX_BUILD"] in ["1", "true"],
      do: {:source, "LLAMA_CPP_EX_BUILD=1"},
      else: :ok
  end

  defp checksums_or_source(:none), do: {:source, :checkout}
  defp checksums_or_source(other), do: other

  defp target_or_source({:ok, t}), do: {:ok, t}

  defp target_or_source({:error, arch}),
    do: {:source, "no precompiled artifact is published for #{arch}"}

  # The newest published NIF version this VM loads (a NIF built for 2.16 loads on 2.16+).
  defp nif_or_source(runtime) do
    case Enum.filter(@nif_versions, &(version_tuple(&1) <= version_tuple(runtime))) do
      [] -> {:source, "no precompiled artifact for NIF version #{runtime}"}
      found -> {:ok, Enum.max_by(found, &version_tuple/1)}
    end
  end

  defp version_tuple(v), do: v |> String.split(".") |> Enum.map(&String.to_integer/1)

  defp describe(target, nil), do: target
  defp describe(target, variant), do: "#{target} (LLAMA_BACKEND=#{variant})"

  def runtime_nif_version, do: to_string(:erlang.system_info(:nif_version))

  @doc "`:ok` when a source build can run (`cargo` is the path found, or nil), else what to do."
  def check_cargo(_reason, cargo) when is_binary(cargo), do: :ok

  def check_cargo(reason, nil) do
    why = if reason == :checkout, do: "no #{@checksum_file}", else: reason

    {:error,
     "LlamaCppEx must be built from source here (#{why}), and that needs cargo, which is " <>
       "not on the PATH: install a Rust toolchain (https://rustup.rs), or use a package with " <>
       "a precompiled artifact for this machine"}
  end

  @doc """
  Installs artifact `name` (checksum `sha`) into `<dest>`: from the cache when a verified copy
  is there, else downloaded from `<base_url>/<name>` and verified. Returns `:ok`,
  `{:ok, :already_installed}` or `{:error, message}`; nothing is installed on error.

  `opts`: `:dest`, `:base_url`, `:cache_dir`, `:env`.
  """
  def install(name, sha, opts) do
    dest = Keyword.fetch!(opts, :dest)

    if installed?(dest, name, sha) do
      {:ok, :already_installed}
    else
      with {:ok, tarball} <- fetch(name, sha, opts),
           :ok <- unpack(tarball, dest, name) do
        File.write!(Path.join(dest, @stamp), "#{name} #{sha}\n")
        :ok
      end
    end
  end

  defp installed?(dest, name, sha) do
    File.read(Path.join(dest, @stamp)) == {:ok, "#{name} #{sha}\n"} and
      Enum.all?(@files, &File.regular?(Path.join(dest, &1)))
  end

  @doc "The verified tarball's path: cached, or downloaded into the cache."
  def fetch(name, sha, opts) do
    cache_dir = Keyword.fetch!(opts, :cache_dir)
    cached = Path.join(cache_dir, name)

    if File.regular?(cached) and sha256(File.read!(cached)) == sha do
      {:ok, cached}
    else
      url = String.trim_trailing(Keyword.fetch!(opts, :base_url), "/") <> "/" <> name

      with {:ok, body} <- download(url, name, Keyword.get(opts, :env, System.get_env())),
           :ok <- verify(body, sha, name, url) do
        File.mkdir_p!(cache_dir)
        tmp = cached <> ".part#{System.unique_integer([:positive])}"
        File.write!(tmp, body)
        File.rename!(tmp, cached)
        {:ok, cached}
      end
    end
  end

  defp verify(body, sha, name, url) do
    case sha256(body) do
      ^sha ->
        :ok

      got ->
        {:error,
         "checksum mismatch for #{name} (downloaded from #{url}): expected #{sha}, got #{got}. " <>
           "The file was not installed. Check the mirror at LLAMA_CPP_EX_BASE_URL, or build " <>
           "from source with LLAMA_CPP_EX_BUILD=1 (needs cargo)"}
    end
  end

  def sha256(bytes), do: "sha256:" <> Base.encode16(:crypto.hash(:sha256, bytes), case: :lower)

  defp download(url, name, env) do
    with :ok <- start_http() do
      request = {String.to_charlist(url), [{~c"user-agent", ~c"llama_cpp_ex"}]}
      http_opts = [timeout: 600_000, connect_timeout: 30_000, autoredirect: true] ++ ssl(url, env)

      case :httpc.request(:get, request, http_opts, [body_format: :binary], profile(url, env)) do
        {:ok, {{_, 200, _}, headers, body}} ->
          check_length(headers, body, name, url)

        {:ok, {{_, status, _}, _, _}} ->
          {:error,
           "HTTP #{status} for #{url}: #{name} is not there. Set LLAMA_CPP_EX_BASE_URL to a " <>
             "mirror that holds it, or build from source with LLAMA_CPP_EX_BUILD=1 (needs cargo)"}

        {:error, reason} ->
          {:error,
           "cannot download #{name} from #{url} (#{inspect(reason)}), and no verified copy is " <>
             "cached. Set LLAMA_CPP_EX_BASE_URL to a reachable mirror, or build from source " <>
             "with LLAMA_CPP_EX_BUILD=1 (needs cargo)"}
      end
    end
  end

  defp check_length(headers, body, name, url) do
    case List.keyfind(headers, ~c"content-length", 0) do
      {_, len} when is_list(len) ->
        if List.to_integer(len) == byte_size(body),
          do: {:ok, body},
          else: truncated(name, url, byte_size(body), List.to_integer(len))

      _ ->
        {:ok, body}
    end
  end

  defp truncated(name, url, got, want),
    do:
      {:error,
       "truncated download of #{name} from #{url}: #{got} of #{want} bytes. Nothing was " <>
         "installed; run `mix compile` again, or build from source with LLAMA_CPP_EX_BUILD=1"}

  defp start_http do
    with {:ok, _} <- Application.ensure_all_started(:inets),
         {:ok, _} <- Application.ensure_all_started(:ssl) do
      :ok
    else
      {:error, reason} -> {:error, "cannot start :inets/:ssl: #{inspect(reason)}"}
    end
  end

  # An :httpc profile of its own, its proxy from HTTPS_PROXY / HTTP_PROXY unless NO_PROXY
  # names the host (the Hub's environment variables).
  defp profile(url, env) do
    case proxy_for(url, env) do
      nil ->
        start_profile(:llama_cpp_ex_precompiled)

      %URI{host: h, port: p} ->
        profile = start_profile(:llama_cpp_ex_precompiled_proxy)
        proxy = {{String.to_charlist(h), p}, []}
        :ok = :httpc.set_options([proxy: proxy, https_proxy: proxy], profile)
        profile
    end
  end

  defp start_profile(profile) do
    case :inets.start(:httpc, profile: profile) do
      {:ok, _} -> profile
      {:error, {:already_started, _}} -> profile
    end
  end

  defp proxy_for(url, env) do
    uri = URI.parse(url)
    get = fn k -> env[k] || env[String.downcase(k)] end
    var = if uri.scheme == "https", do: get.("HTTPS_PROXY"), else: get.("HTTP_PROXY")

    no_proxy =
      (get.("NO_PROXY") || "") |> String.split(",", trim: true) |> Enum.map(&String.trim/1)

    bypass =
      Enum.any?(no_proxy, fn e ->
        e == "*" or uri.host == e or String.ends_with?(uri.host || "", "." <> String.trim(e, "."))
      end)

    case var || get.("ALL_PROXY") do
      p when p in [nil, ""] -> nil
      _ when bypass -> nil
      p -> URI.parse(if p =~ "://", do: p, else: "http://" <> p)
    end
  end

  # HTTPS verifies the peer against LLAMA_CPP_EX_CACERTFILE (a PEM bundle) or the OS store.
  defp ssl("https" <> _ = _url, env) do
    cas =
      case env["LLAMA_CPP_EX_CACERTFILE"] do
        f when f in [nil, ""] -> [cacerts: :public_key.cacerts_get()]
        file -> [cacertfile: String.to_charlist(file)]
      end

    [
      ssl:
        [
          verify: :verify_peer,
          depth: 4,
          customize_hostname_check: [
            match_fun: :public_key.pkix_verify_hostname_match_fun(:https)
          ]
        ] ++ cas
    ]
  end

  defp ssl(_url, _env), do: []

  @doc """
  Unpacks `tarball` into `dest`: every entry must be a regular file named in `files/0` (no
  folders, links, absolute or `..` paths); they land in a staging folder first and are moved
  into `dest` only when all are there.
  """
  def unpack(tarball, dest, name) do
    with {:ok, entries} <- list_entries(tarball, name),
         :ok <- check_entries(entries, name) do
      staging = Path.join(dest, ".staging-#{System.unique_integer([:positive])}")
      File.mkdir_p!(staging)

      try do
        case :erl_tar.extract(String.to_charlist(tarball), [
               :compressed,
               cwd: String.to_charlist(staging)
             ]) do
          :ok ->
            for f <- @files do
              File.chmod!(Path.join(staging, f), 0o755)
              File.rename!(Path.join(staging, f), Path.join(dest, f))
            end

            :ok

          {:error, reason} ->
            {:error, "cannot unpack #{name}: #{inspect(reason)}"}
        end
      after
        File.rm_rf!(staging)
      end
    end
  end

  defp list_entries(tarball, name) do
    case :erl_tar.table(String.to_charlist(tarball), [:compressed, :verbose]) do
      {:ok, entries} ->
        {:ok, Enum.map(entries, fn {n, type, _, _, _, _, _} -> {to_string(n), type} end)}

      {:error, reason} ->
        {:error, "#{name} is not a readable archive (#{inspect(reason)}); nothing was installed"}
    end
  end

  defp check_entries(entries, name) do
    bad =
      Enum.reject(entries, fn {path, type} ->
        type == :regular and path in @files
      end)

    missing = @files -- Enum.map(entries, &elem(&1, 0))

    cond do
      bad != [] ->
        {path, type} = hd(bad)

        {:error,
         "#{name} holds #{inspect(path)} (#{type}), which is not one of #{inspect(@files)} " <>
           "at the archive's top level; refusing to unpack it. The artifact is not one a " <>
           "release step made: check the mirror, or build from source with LLAMA_CPP_EX_BUILD=1"}

      missing != [] ->
        {:error, "#{name} lacks #{Enum.join(missing, ", ")}; nothing was installed"}

      true ->
        :ok
    end
  end

  @doc "Packs the built `files/0` in `dir` as `out`; returns its checksum."
  def pack(dir, out) do
    File.mkdir_p!(Path.dirname(out))

    entries = for f <- @files, do: {String.to_charlist(f), String.to_charlist(Path.join(dir, f))}

    :ok = :erl_tar.create(String.to_charlist(out), entries, [:compressed])
    sha256(File.read!(out))
  end

  @doc "Writes the checksum file in `dir`, merged with the entries already there."
  def write_checksums(dir, new) do
    old =
      case read_checksums(dir) do
        {:ok, m} -> m
        _ -> %{}
      end

    map = Map.merge(old, new)

    body =
      "%{\n" <>
        Enum.map_join(Enum.sort(map), "", fn {k, v} -> "  #{inspect(k)} => #{inspect(v)},\n" end) <>
        "}\n"

    File.mkdir_p!(dir)
    File.write!(Path.join(dir, @checksum_file), body)
    Path.join(dir, @checksum_file)
  end
end
